"""The NVMe tier end to end on real vLLM engines: hits from NVMe within one process when
the CPU tier is tiny, across a restart, and after crashes and corruption."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.conftest import (
    BLOCK_SIZE,
    Result,
    close_llm,
    generate,
    is_multiprocess,
    kvtier_config,
    kvtier_counters,
    make_llm,
    rand_tokens,
    settle,
)

ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4  # tiny model, fp32: layers x heads x block x 2*head x 4


def nvme_config(path: Path, *, cpu_blocks: int = 4, **nvme) -> dict:
    return kvtier_config({
        "cpu": {"capacity_bytes": cpu_blocks * BLOCK_BYTES},
        "nvme": {"path": str(path), "capacity_bytes": 64 * 2**20, "admit_min_seen": 1,
                 "chunk_blocks": 4, **nvme},
    })


def prompts(seed: int, n: int, length: int = 330) -> list[list[int]]:
    rng = random.Random(seed)
    return [rand_tokens(rng, length) for _ in range(n)]


#: Every prompt set used below (their baselines are computed once, on one engine).
SETS = {seed: prompts(seed, n) for seed, n in [(1, 4), (2, 2), (3, 1), (4, 6)]}
#: Prompts of exactly 10 blocks: an async load (every load from NVMe) covers all of them.
SETS[5] = prompts(5, 2, length=10 * BLOCK_SIZE)


def loadable_blocks(prompt: list[int]) -> int:
    """Blocks of ``prompt`` a load from a tier below CPU (always async) supplies: every
    full one (vLLM recomputes only the last token when the whole prompt was loaded)."""
    return len(prompt) // BLOCK_SIZE


@pytest.fixture(scope="module")
def baseline_of(tiny_model):
    """Greedy tokens of each prompt on an engine without the plugin. (Two in-process
    engines cannot be alive at once, so they are all computed first.)"""
    llm = make_llm(tiny_model, None)
    try:
        table = {tuple(p): generate(llm, p).tokens for ps in SETS.values() for p in ps}
    finally:
        close_llm(llm)
    return lambda p: table[tuple(p)]


def run_process(model: Path, kv: dict, ps: list[list[int]], tmp: Path, *, kill_after_files: Path | None = None,
                max_tokens: int = 8, multiprocess: bool = False) -> dict | None:
    """Run ``ps`` on a fresh engine process; with ``kill_after_files``, SIGKILL it as soon
    as chunk files appear there (a crash in the middle of writing). ``multiprocess``: the
    engine as ``vllm serve`` runs it (EngineCore and the worker in processes of their own)."""
    pfile = tmp / f"prompts-{time.monotonic_ns()}.json"
    pfile.write_text(json.dumps(ps))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(ROOT),
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0")
    cmd = [sys.executable, "-m", "tests.engine_run", str(model), json.dumps(kv), str(pfile), str(max_tokens)]
    if kill_after_files is None:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert proc.returncode == 0 and line, proc.stderr[-4000:]
        return json.loads(line.removeprefix("RESULT "))
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if any(f.name.endswith(".kvt") for f in kill_after_files.rglob("*")):
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    return None


def run_engine(model: Path, kv: dict, ps: list[list[int]], *, max_tokens: int = 8) -> dict:
    """Run ``ps`` on a fresh engine in this process and close it (its tiers flush and
    close as at a process's exit); the same result as :func:`run_process`. For tests
    whose subject is what one engine leaves to the next, not a process boundary: this
    saves importing vLLM again (~8 s of one core)."""
    llm = make_llm(model, kv)
    try:
        res = [generate(llm, p, max_tokens) for p in ps]
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    return {"results": {str(i): asdict(r) for i, r in enumerate(res)}, "counters": counters}


def results(data: dict) -> list[Result]:
    return [Result(**data["results"][str(i)]) for i in range(len(data["results"]))]


def test_tiny_cpu_tier_hits_come_from_nvme(tiny_model, baseline_of, tmp_path):
    """A CPU tier of 12 blocks under 40 blocks of traffic: repeated prompts come back from
    NVMe (the CPU tier demoted them), through CPU slots, with the same tokens."""
    ps = SETS[1]
    llm = make_llm(tiny_model, nvme_config(tmp_path / "nvme", cpu_blocks=12))
    try:
        first = [generate(llm, p) for p in ps]
        settle(llm)  # the demotions of the last steps are reported durable, as between requests
        again = [generate(llm, p) for p in ps]
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    for p, r in zip(ps + ps, first + again, strict=True):
        assert r.tokens == baseline_of(p)
    loadable = (330 - 1) // BLOCK_SIZE
    assert [r.loaded + r.loaded_nvme for r in again] == [loadable] * len(ps)
    assert again[0].loaded_nvme == loadable  # evicted from DRAM long ago: all from NVMe
    assert counters["blocks_stored|nvme"] > 0 and counters["evictions|cpu"] > 0
    assert 0 < counters["usage_bytes|nvme"] <= 64 * 2**20


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_restart_serves_hits_from_nvme(tiny_model, baseline_of, tmp_path, mode):
    """Engine 1 stores; it stops; engine 2 (same directory, empty DRAM) loads from NVMe.
    Write-back relies on the flush, at the process's exit, of blocks still only in DRAM:
    its engines are processes of their own. Write-through has written every block before
    the engine stops, so its engines run one after the other in this process."""
    ps = SETS[2]
    kv = nvme_config(tmp_path / "nvme", cpu_blocks=64, mode=mode)
    if mode == "write-back":
        run_process(tiny_model, kv, ps, tmp_path)
    else:
        run_engine(tiny_model, kv, ps)
    assert list((tmp_path / "nvme").rglob("*.kvt")), "engine 1 left no chunk files"
    data = run_process(tiny_model, kv, ps, tmp_path) if mode == "write-back" else run_engine(tiny_model, kv, ps)
    got = results(data)
    for p, r in zip(ps, got, strict=True):
        assert r.tokens == baseline_of(p)
    assert data["counters"].get("blocks_loaded|nvme", 0) == 2 * ((330 - 1) // BLOCK_SIZE)


@pytest.mark.parametrize("set_id", [2, 5], ids=["330-tokens", "320-tokens-whole-blocks"])
def test_restart_is_warm_with_the_default_config(tiny_model, baseline_of, tmp_path, set_id):
    """Only ``cpu`` and ``nvme`` (path, capacity) given: write-back, admit_min_seen 1. Prompts
    seen once are still on NVMe for the next engine (the shutdown flush and the idle flush
    ignore admission counts), and it loads them with the baseline's tokens: every full
    block, the last one too for a prompt of whole blocks. The 330-token case runs each
    engine in a process of its own (the flush at the process's exit); the whole-block case
    tests what is loaded, so its engines run one after the other in this process. The exit
    flush in a multiprocess engine's worker is tested by test_s3_engine's multiprocess
    case, a warm ``vllm serve`` by test_serving's restarts."""
    ps = SETS[set_id]
    kv = kvtier_config({"cpu": {"capacity_bytes": 64 * BLOCK_BYTES},
                        "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 64 * 2**20}})

    def run() -> dict:
        return run_process(tiny_model, kv, ps, tmp_path) if set_id == 2 else run_engine(tiny_model, kv, ps)

    run()
    assert list((tmp_path / "nvme").rglob("*.kvt")), "engine 1 left no chunk files"
    data = run()
    for p, r in zip(ps, results(data), strict=True):
        assert r.tokens == baseline_of(p)
    assert data["counters"].get("blocks_loaded|nvme", 0) == sum(loadable_blocks(p) for p in ps)


def test_last_request_before_exit_is_stored(tiny_model, tmp_path):
    """Offline use: the engine stops stepping when the last request returns (here after
    one token). Its blocks must already be stored: a fresh engine loads all of them."""
    ps = SETS[3]
    kv = nvme_config(tmp_path / "nvme", cpu_blocks=64, mode="write-through")
    run_process(tiny_model, kv, ps, tmp_path, max_tokens=1)
    data = run_engine(tiny_model, kv, ps, max_tokens=1)  # what the process left: read in this one
    assert data["counters"].get("blocks_loaded|nvme", 0) == (330 - 1) // BLOCK_SIZE


def test_namespace_isolation(tiny_model, tmp_path):
    """An engine with another block size shares the directory but never reads the files."""
    ps = SETS[3]
    kv = nvme_config(tmp_path / "nvme", cpu_blocks=64, mode="write-through")
    run_engine(tiny_model, kv, ps)
    llm = make_llm(tiny_model, kv, block_size=64)
    try:
        r = generate(llm, ps[0])
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert r.loaded == 0 and counters.get("blocks_loaded|nvme", 0) == 0
    assert len({p.parent.parent.name for p in (tmp_path / "nvme").rglob("*.kvt")}) == 2


def test_sigkill_mid_write_then_corruption(tiny_model, baseline_of, tmp_path):
    """Kill the writer while it writes chunk files; restart: nothing torn is served. Then
    corrupt bytes of stored files: those blocks recompute, tokens stay correct."""
    ps = SETS[4]
    kv = nvme_config(tmp_path / "nvme", cpu_blocks=64, mode="write-through")
    run_process(tiny_model, kv, ps, tmp_path, kill_after_files=tmp_path / "nvme")
    data = run_engine(tiny_model, kv, ps)  # the restarts run in this process
    for p, r in zip(ps, results(data), strict=True):
        assert r.tokens == baseline_of(p)
    assert not list((tmp_path / "nvme").rglob(".tmp-*")), "partial writes must be cleaned up"

    files = sorted((tmp_path / "nvme").rglob("*.kvt"))
    assert files
    for f in files[::2]:  # flip bytes inside the first block's payload of every other file
        with open(f, "r+b") as fh:
            fh.seek(4096 + 100)
            b = fh.read(8)
            fh.seek(4096 + 100)
            fh.write(bytes(x ^ 0xFF for x in b))
    data = run_engine(tiny_model, kv, ps)
    for p, r in zip(ps, results(data), strict=True):
        assert r.tokens == baseline_of(p)
    assert data["counters"].get("load_failures|nvme", 0) > 0
    assert data["counters"].get("blocks_loaded|nvme", 0) > 0


def test_read_only_nvme_directory_degrades_to_misses(tiny_model, baseline_of, tmp_path):
    """The NVMe directory sits on a read-only filesystem (a real read-only bind mount):
    the engine starts, serves correct tokens from recompute and the CPU tier, and counts
    the failed writes; nothing raises."""
    import shutil

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a real read-only filesystem")
    ro = tmp_path / "ro"
    ro.mkdir()
    cmds = [["mount", "--bind", str(ro), str(ro)], ["mount", "-o", "remount,bind,ro", str(ro)]]
    r = subprocess.run(cmds[0], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount not permitted here: {r.stderr.strip()}")
    try:
        if subprocess.run(cmds[1], capture_output=True).returncode != 0:
            pytest.skip("read-only remount not permitted here")
        ps = SETS[1]
        llm = make_llm(tiny_model, nvme_config(ro / "nvme", cpu_blocks=12))
        try:
            seq = ps + ps[-1:]  # the last prompt twice in a row: a DRAM hit
            got = [generate(llm, p) for p in seq]
            counters = kvtier_counters(llm)
        finally:
            close_llm(llm)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
    assert [g.tokens for g in got] == [baseline_of(p) for p in seq]
    assert counters.get("store_failures|nvme", 0) > 0
    assert counters.get("blocks_loaded|nvme", 0) == 0
    assert got[-1].loaded == (330 - 1) // BLOCK_SIZE  # the DRAM tier still serves


def test_signed_nvme_chunks_with_auth_local_tiers(tiny_model, baseline_of, tmp_path, monkeypatch):
    """``auth.local_tiers``: with the key, NVMe chunk files are signed and a restart loads
    them (the scanned headers are re-verified on read); without the key the same files
    are never indexed: the owner's start-up scan drops them (counted; its own directory,
    so they are deleted, as a rotation's retired key's would be) and the prompts are
    recomputed with the baseline's tokens; with ``auth.required`` and no key the engine
    refuses to start, naming the field (in a process of its own: its error is read from
    there). The engines before it run one after the other in this process."""
    from vllm_kvtier.chunkformat import decode_header

    ps = SETS[2]
    kv = nvme_config(tmp_path / "nvme", cpu_blocks=64, mode="write-through")
    kv["kv_connector_extra_config"]["auth"] = {"local_tiers": True}
    monkeypatch.setenv("KVTIER_AUTH_KEY", "3e" * 32)
    run_engine(tiny_model, kv, ps)
    files = sorted((tmp_path / "nvme").rglob("*.kvt"))
    assert files
    head = files[0].read_bytes()
    assert decode_header(head, head[12:28].rstrip(b"\0").decode()).authenticated
    loadable = 2 * ((330 - 1) // BLOCK_SIZE)
    data = run_engine(tiny_model, kv, ps)
    assert [r.tokens for r in results(data)] == [baseline_of(p) for p in ps]
    assert data["counters"].get("blocks_loaded|nvme", 0) == loadable
    assert data["counters"].get("auth_failures|nvme", 0) == 0

    monkeypatch.delenv("KVTIER_AUTH_KEY")
    data = run_engine(tiny_model, kv, ps)
    assert [r.tokens for r in results(data)] == [baseline_of(p) for p in ps]
    c = data["counters"]
    assert c.get("blocks_loaded|nvme", 0) == 0 and c.get("reclaimed_files|nvme", 0) >= len(files), c
    assert not any(f.exists() for f in files), "chunks this instance cannot accept are the owner's debris"

    kv["kv_connector_extra_config"]["auth"]["required"] = True
    with pytest.raises(AssertionError, match="auth.required"):
        run_process(tiny_model, kv, ps[:1], tmp_path)


def test_second_engine_on_the_same_directory_serves_without_it(tiny_model, baseline_of, tmp_path):
    """Reproduced bug: a second engine on the same NVMe directory deleted the first one's
    in-flight writes at start-up. Now the directory's lock turns it away: it logs an ERROR,
    serves the baseline's tokens without the NVMe tier (0 blocks from it), and every file
    of the first engine (a write still in flight too: a ``.tmp-`` file) is untouched; the
    first engine then loads its prompts from NVMe."""
    ps = SETS[1]
    kv = nvme_config(tmp_path / "nvme", cpu_blocks=12)
    llm = make_llm(tiny_model, kv)
    try:
        first = [generate(llm, p) for p in ps]
        settle(llm)  # the demotions are reported durable, as between requests
        (rank0,) = [p.parent for p in (tmp_path / "nvme").rglob(".lock")]
        in_flight = rank0 / ".tmp-0123456789abcdef-0badf00d"
        in_flight.write_bytes(b"\0" * 8192)

        def snapshot() -> dict[str, tuple[int, int]]:
            return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in rank0.iterdir()}

        before = snapshot()
        assert any(n.endswith(".kvt") for n in before)
        data = run_process(tiny_model, kv, ps, tmp_path)
        assert snapshot() == before
        again = [generate(llm, p) for p in ps]
    finally:
        close_llm(llm)
    for p, r in zip(ps, results(data), strict=True):
        assert r.tokens == baseline_of(p)
    assert data["counters"].get("blocks_loaded|nvme", 0) == 0
    assert data["counters"].get("store_failures|nvme", 0) >= 1
    for p, r in zip(ps + ps, first + again, strict=True):
        assert r.tokens == baseline_of(p)
    assert again[0].loaded_nvme == (330 - 1) // BLOCK_SIZE
    assert in_flight.exists()


def test_a_tier_that_fails_to_close_leaves_no_connector_behind(tiny_model, baseline_of, tmp_path, monkeypatch):
    """The NVMe tier's close raises at shutdown: the connector still closes every other
    part, and vLLM's connector global is cleared, so the next in-process engine (here one
    without the plugin) serves on its own. (Before, the raise left the old connector
    installed, and the next engine failed its first step on vLLM's ``assert
    kv_connector_metadata is not None``.)"""
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    from vllm_kvtier.transfer.tier_io import ChunkWorker

    real_close = ChunkWorker.close
    closed: list[str] = []

    def failing_close(self: ChunkWorker) -> None:
        closed.append(self.tier)
        real_close(self)
        raise OSError("injected: the tier could not close")

    monkeypatch.setattr(ChunkWorker, "close", failing_close)
    p = SETS[3][0]
    llm = make_llm(tiny_model, nvme_config(tmp_path / "nvme"))
    try:
        assert not is_multiprocess(llm), "vLLM's connector global is this process's only in-process"
        assert generate(llm, p).tokens == baseline_of(p)
    finally:
        close_llm(llm)
    assert closed == ["nvme"], "the failing close ran"
    assert not has_kv_transfer_group(), "the connector is gone from vLLM's global"
    monkeypatch.undo()
    llm = make_llm(tiny_model, None)
    try:
        assert generate(llm, p).tokens == baseline_of(p)
    finally:
        close_llm(llm)
