"""Throughput of our NIXL agent (``NixlAgent.submit_read``) against the raw NIXL API reading
the same descriptors, between two processes on 127.0.0.1 over UCX.

The peer path of P/D disaggregation: the prefill side registers a CPU block pool; the
decode side (this process) reads a request's blocks out of it, scattered across the pool,
into its own consecutive blocks. A spawned peer process (a ``NixlAgent`` registering
``--pool-mib`` of memory in which every 8-byte word holds its own offset) publishes its
``PeerInfo`` over a pipe, then only drains notifications. This process has two agents
connected to it, each reading into its own registered buffer:

* ``ours``: ``NixlAgent.submit_read(job, peer, spans, notif=...)`` per job, completions by
  ``NixlAgent.poll``: spans checked against the published regions, descriptor lists built
  from the Python spans, ``initialize_xfer`` + ``transfer``, ``check_xfer_state``, release;
* ``raw``: nixl's own ``nixl_agent``: ``get_xfer_descs`` of the same (address, length)
  arrays (built before the clock starts), ``initialize_xfer("READ", ..., notif)`` +
  ``transfer`` per job, ``check_xfer_state`` until every job is ``DONE``, ``release``.

Each pass reads ``--total-mib`` (every pool block once, in a random order) as jobs of
``--job-mib`` (one request's KV), all submitted at once, for each block size of
``--block-kib`` (64 KiB to 2 MiB pieces). Wall time from the first submit until every job
is done. Passes alternate which side goes first (``--repeats``). Every block's first word
is checked after every pass (the tags are cleared before it), and the first pass of each
case compares every byte. The table shows medians, ratio ours/raw (target >= 0.8) and the
paired ratio (median over passes of the ratio within a pass).

UCX picks its transports (cma, i.e. process_vm_readv, for the bytes on one host; ``UCX_TLS``
overrides). ``UCX_MODULES=^ib`` is set unless the caller set it: without an RDMA NIC but
with libibverbs' provider plugins installed, a process that used UCX can crash at exit.

    python bench/nixl_throughput.py                          # 64 KiB, 256 KiB, 2 MiB blocks
    python bench/nixl_throughput.py --block-kib 128 --total-mib 512 --repeats 9

The machine is shared and noisy: compare ratios from the same run, not MB/s across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("UCX_MODULES", "^ib")  # before any agent, and inherited by the peer (see the doc)
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import save_json  # noqa: E402
from vllm_kvtier.tiers.nixl.agent import NixlAgent, NixlConfig, PeerInfo  # noqa: E402

MB = 1e6
MiB = 1 << 20
KiB = 1 << 10
TARGET = 0.8
WORD = np.dtype("<u8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-kib", default="64,256,2048", help="comma-separated block sizes, KiB")
    p.add_argument("--total-mib", type=int, default=256, help="bytes read per pass (= the peer's pool), MiB")
    p.add_argument("--job-mib", type=int, default=16, help="bytes per job (one request's blocks), MiB")
    p.add_argument("--repeats", type=int, default=7, help="passes per side and block size")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "nixl_throughput.json"))
    a = p.parse_args(argv)
    a.blocks = [int(x) * KiB for x in a.block_kib.split(",") if x.strip()]
    if not a.blocks or min(a.blocks) < 8 or min(a.total_mib, a.job_mib, a.repeats) <= 0:
        p.error("block sizes >= 8 bytes; sizes and --repeats must be positive")
    if any(a.total_mib * MiB % b or a.job_mib * MiB % b for b in a.blocks):
        p.error("--total-mib and --job-mib must be multiples of every block size")
    return a


# ---- the prefill side -------------------------------------------------------------------------


def serve(conn: Connection, name: str, nbytes: int) -> None:
    """The peer process: a pool whose every 8-byte word holds its own byte offset."""
    pool = np.arange(0, nbytes, 8, dtype=WORD)
    agent = NixlAgent(name)
    agent.register(pool)
    conn.send(agent.peer_info().to_dict())
    notifs = 0
    try:
        while True:
            notifs += sum(len(v) for v in agent.get_notifs().values())
            if conn.poll(0.005):
                msg = conn.recv()
                if msg == "exit":
                    return
                conn.send(notifs)  # "count": how many read notifications arrived so far
    finally:
        agent.close()


# ---- the two readers ----------------------------------------------------------------------------


class Case:
    """One block size: the pool's blocks in a random order, cut into jobs; local block i of a
    job's destination gets remote block ``order[i]``."""

    def __init__(self, block: int, total: int, job: int, seed: int) -> None:
        self.block, self.nblocks, self.per_job = block, total // block, job // block
        self.order = list(range(self.nblocks))
        random.Random(seed + block).shuffle(self.order)
        self.njobs = self.nblocks // self.per_job
        self.bytes = self.nblocks * block

    def spans(self, local_base: int, remote_base: int) -> list[list[tuple[int, int, int]]]:
        b, k = self.block, self.per_job
        return [[(local_base + i * b, remote_base + self.order[i] * b, b) for i in range(j * k, (j + 1) * k)]
                for j in range(self.njobs)]

    def clear(self, dst: np.ndarray) -> None:
        dst.view(WORD)[:: self.block // 8] = np.iinfo(np.uint64).max

    def check(self, dst: np.ndarray, full: bool) -> int:
        """Blocks whose bytes are not the remote block's (first word, or every word if ``full``)."""
        words = dst.view(WORD)[: self.bytes // 8].reshape(self.nblocks, self.block // 8)
        want = np.asarray(self.order, dtype=WORD) * self.block
        if not full:
            return int(np.count_nonzero(words[:, 0] != want))
        expect = want[:, None] + np.arange(0, self.block, 8, dtype=WORD)[None, :]
        return int(np.count_nonzero((words != expect).any(axis=1)))


def run_ours(agent: NixlAgent, peer: str, jobs: list[list[tuple[int, int, int]]], tag: str) -> float:
    t0 = time.perf_counter()
    for j, spans in enumerate(jobs):
        agent.submit_read(j, peer, spans, notif=f"{tag}-{j}".encode())
    done, failed = 0, []
    while done < len(jobs):
        for r in agent.poll():
            done += 1
            if not r.ok:
                failed.append(r.reason)
    secs = time.perf_counter() - t0
    if failed:
        raise RuntimeError(f"ours: {len(failed)} reads failed: {sorted(set(failed))}")
    return secs


def run_raw(agent: Any, peer: str, jobs: list[tuple[np.ndarray, np.ndarray]], tag: str) -> float:
    t0 = time.perf_counter()
    handles = []
    for j, (local, remote) in enumerate(jobs):
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"),
                                  peer, f"{tag}-{j}".encode())
        state = agent.transfer(h)
        if state == "ERR":
            raise RuntimeError("raw: transfer failed")
        handles.append(h)
    live = handles
    while live:
        still = []
        for h in live:
            state = agent.check_xfer_state(h)
            if state == "DONE":
                h.release()
            elif state == "PROC":
                still.append(h)
            else:
                raise RuntimeError(f"raw: transfer state {state}")
        live = still
    return time.perf_counter() - t0


def as_arrays(jobs: list[list[tuple[int, int, int]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array([(la, n, 0) for la, _, n in spans], dtype=np.uint64),
             np.array([(ra, n, 0) for _, ra, n in spans], dtype=np.uint64)) for spans in jobs]


# ---- main -------------------------------------------------------------------------------------


def raw_nixl() -> tuple[Any, Any]:
    """NIXL's own agent class and config (the wheel's variant directly: ``import nixl`` picks
    one through torch, a slow import this script does not need)."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        with contextlib.suppress(ImportError):
            api = importlib.import_module(f"{name}._api")
            return api.nixl_agent, api.nixl_agent_config
    raise ImportError("nixl is not installed (tools/setup-remote.sh installs it)")


def nixl_version() -> str:
    for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return "?"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    total, job = a.total_mib * MiB, a.job_mib * MiB
    t_all = time.perf_counter()
    tag = f"{os.getpid()}"
    ctx = mp.get_context("spawn")
    ours_end, peer_end = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(peer_end, f"bench-prefill-{tag}", total), daemon=True)
    proc.start()
    ours = raw = None
    cases: list[dict[str, Any]] = []
    try:
        if not ours_end.poll(120):
            raise RuntimeError("the peer process did not publish its agent")
        info = PeerInfo.from_dict(ours_end.recv())
        remote = info.regions[0]

        ours = NixlAgent(f"bench-decode-ours-{tag}", NixlConfig(deadline_s=120.0))
        dst_ours = np.zeros(total, dtype=np.uint8)
        local_ours = ours.register(dst_ours)
        ours.add_peer(info)

        nixl_agent, nixl_agent_config = raw_nixl()
        raw = nixl_agent(f"bench-decode-raw-{tag}", nixl_agent_config(backends=["UCX"], num_threads=0))
        dst_raw = np.zeros(total, dtype=np.uint8)
        raw_reg = raw.register_memory([(int(dst_raw.ctypes.data), total, 0, "")], "DRAM")
        if raw.add_remote_agent(info.metadata) not in (info.name, info.name.encode()):
            raise RuntimeError("raw: the peer metadata names another agent")
        print(f"peer pid {proc.pid}: {total / MiB:.0f} MiB pool; each pass reads all of it in a random order, "
              f"{a.job_mib} MiB per job, all jobs in flight; {a.repeats} passes per side; "
              f"UCX_MODULES={os.environ.get('UCX_MODULES')!r} UCX_TLS={os.environ.get('UCX_TLS', '(default)')!r}",
              flush=True)

        for block in a.blocks:
            c = Case(block, total, job, a.seed)
            ours_jobs = c.spans(local_ours.addr, remote.addr)
            raw_jobs = as_arrays(c.spans(int(dst_raw.ctypes.data), remote.addr))
            # One untimed pass each: connection set-up and first-touch costs out of the timings.
            run_ours(ours, info.name, ours_jobs, "warm")
            run_raw(raw, info.name, raw_jobs, "warm")
            times: dict[str, list[float]] = {"ours": [], "raw": []}
            wrong = {"ours": 0, "raw": 0}
            for i in range(a.repeats):
                for who in ("ours", "raw") if i % 2 == 0 else ("raw", "ours"):
                    dst = dst_ours if who == "ours" else dst_raw
                    c.clear(dst)
                    if who == "ours":
                        secs = run_ours(ours, info.name, ours_jobs, f"o{block}-{i}")
                    else:
                        secs = run_raw(raw, info.name, raw_jobs, f"r{block}-{i}")
                    times[who].append(secs)
                    wrong[who] += c.check(dst, full=i == 0)
            if any(wrong.values()):
                raise RuntimeError(f"block {block}: wrong blocks read {wrong}")
            mo, mr = statistics.median(times["ours"]), statistics.median(times["raw"])
            rec = {"case": f"{block // KiB}KiB", "block_bytes": block, "spans_per_job": c.per_job, "jobs": c.njobs, "bytes": c.bytes,
                   "ours_MBps": c.bytes / mo / MB, "raw_MBps": c.bytes / mr / MB, "ratio": mr / mo,
                   "paired_ratio": statistics.median(r / o for o, r in zip(times["ours"], times["raw"], strict=True)),
                   "ours_s": times["ours"], "raw_s": times["raw"]}
            cases.append(rec)
            print(f"  {block // KiB:>5} KiB blocks: ours {rec['ours_MBps']:.0f} raw {rec['raw_MBps']:.0f} MB/s "
                  f"(passes ours {', '.join(f'{c.bytes / s / MB:.0f}' for s in times['ours'])}; "
                  f"raw {', '.join(f'{c.bytes / s / MB:.0f}' for s in times['raw'])})", flush=True)
        # Notifications travel after the data (UCX active messages): give the last ones a moment.
        expected_notifs = sum((a.repeats + 1) * 2 * c["jobs"] for c in cases)
        notifs, until = None, time.monotonic() + 5
        while time.monotonic() < until and (notifs is None or notifs < expected_notifs):
            ours_end.send("count")
            notifs = ours_end.recv() if ours_end.poll(10) else None
            time.sleep(0.05)
        raw.deregister_memory(raw_reg)
        raw.remove_remote_agent(info.name)
    finally:
        if ours is not None:
            ours.close()
        with contextlib.suppress(OSError):
            ours_end.send("exit")
        proc.join(30)
        if proc.is_alive():
            proc.kill()

    print()
    print(f"{'block':>8} {'spans/job':>10} {'bytes':>10} {'ours MB/s':>10} {'raw MB/s':>9} {'ratio':>6} {'paired':>7}")
    for c in cases:
        print(f"{c['block_bytes'] // KiB:>5} KiB {c['spans_per_job']:>10} {c['bytes']:>10} {c['ours_MBps']:>10.0f} "
              f"{c['raw_MBps']:>9.0f} {c['ratio']:>6.2f} {c['paired_ratio']:>7.2f}")
    print("(ratio = ours/raw of the median MB/s; paired = median over passes of ours/raw within a pass)")
    print(f"read notifications received by the peer: {notifs} of {expected_notifs}")
    targets = {f"{c['block_bytes'] // KiB}KiB_throughput_ratio_ge_{TARGET}": c["ratio"] >= TARGET for c in cases}
    for name, ok in targets.items():
        print(f"target {name}: {'PASS' if ok else 'FAIL'}")
    total_s = time.perf_counter() - t_all
    print(f"total {total_s:.0f}s, load avg {os.getloadavg()[0]:.2f}")

    result = {
        "benchmark": "nixl_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: v for k, v in vars(a).items()}, "throughput": cases, "targets": targets,
        "notifications": {"received": notifs, "expected": expected_notifs},
        "env": {k: os.environ.get(k) for k in ("UCX_MODULES", "UCX_TLS", "NIXL_LOG_LEVEL")},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "nixl": nixl_version(), "loadavg_end": os.getloadavg(), "total_s": total_s},
    }
    save_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
