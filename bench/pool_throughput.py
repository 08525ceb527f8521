"""Throughput of the Mooncake tier (``MooncakeStore``) against plain Mooncake Store batch calls
of the same bytes, through one real ``mooncake_master`` on 127.0.0.1.

The pool: this script starts a ``mooncake_master`` (testkit/mooncake_server.py) and a second
process that joins the pool with a DRAM segment of ``--segment-mib`` and does nothing
else, like a pool node. Both clients measured here join with no segment of their own, so
every put and every get crosses Mooncake's transfer engine (TCP on this machine; RDMA where
``--protocol rdma``) to that process, as a prefill or decode instance writing to and
reading from a pool hosted elsewhere.

What it measures, in one run, on the same pool:

* ``store``: ``--total-mib`` of payload as chunks of ``--chunk-blocks`` blocks of
  ``--block-bytes`` (default 1 block per object, as the Mooncake tier stores them) through
  ``MooncakeStore.submit_write`` (CRC32 of every block, a header, a copy into the
  registered arena, ``batch_put_from`` of up to ``--batch`` chunks per call on
  ``--threads`` I/O threads), against plain ``MooncakeDistributedStore.batch_put_from`` of
  the same payload bytes from an already registered buffer, ``--batch`` objects per call
  on ``--threads`` long-lived threads (the same concurrency, no copy, no checksum);
* ``load``: ``MooncakeStore.submit_read`` of every block with the caller's header (a chunk
  this instance indexed: ``batch_get_into`` into the arena, header compared, every block's
  CRC32 verified), against plain ``batch_get_into`` of the same objects into a registered
  buffer;
* ``load-pd``: the same reads with no header (``header=None``: the decode side of P/D,
  reading chunks another instance wrote: one ``get_size`` per chunk, then the header is
  decoded and checked), against the same plain ``batch_get_into``.

Wall time from the first submit until every transfer completed; write buffers and the
baseline's registered bytes are filled before the clock starts. Rounds alternate which
side stores first (``--repeats``); then each round loads ``--load-passes`` times, the
three readers rotating pass by pass so drift in the machine's load hits all of them.
Every loaded block's tag (its index, in its first 8 bytes) is checked on both sides; our
store verifies CRC32s itself. Objects are removed after each round. The table shows
medians and the ratio ours/plain (target >= 0.8) and the paired ratio (median over rounds
of the ratio within a round).

MB/s = payload bytes (our objects also carry a 4 KiB header per chunk) / seconds, MB = 1e6 B.

    python bench/pool_throughput.py                       # 256 MiB, 512 KiB blocks, 9 rounds
    python bench/pool_throughput.py --block-bytes 2097152 --chunk-blocks 4 --total-mib 512

The machine is shared and noisy: compare ratios from the same run, not MB/s across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import mmap
import multiprocessing as mp
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import save_json  # noqa: E402
from testkit.mooncake_server import MooncakeMaster  # noqa: E402
from vllm_kvtier.chunkformat import CRC_IMPL, ChunkHeader, align_up, header_bytes_for  # noqa: E402
from vllm_kvtier.tiers.buffers import WriteBuffer  # noqa: E402
from vllm_kvtier.tiers.mooncake.store import MooncakeConfig, MooncakeStore  # noqa: E402
from vllm_kvtier.tiers.registry import StoreContext  # noqa: E402

MB = 1e6
MiB = 1 << 20
TARGET = 0.8
NAMESPACE = "benchpool0000000"  # 16 ASCII chars, as the real namespace digest
READERS = ("ours", "ours-pd", "plain")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total-mib", type=int, default=256, help="payload per phase, MiB")
    p.add_argument("--block-bytes", type=int, default=512 * 1024)
    p.add_argument("--chunk-blocks", type=int, default=1, help="blocks per object (the Mooncake tier uses 1)")
    p.add_argument("--threads", type=int, default=2, help="MooncakeStore io_threads = plain baseline threads")
    p.add_argument("--batch", type=int, default=16, help="MooncakeStore max_batch = plain objects per batch call")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--load-passes", type=int, default=3, help="load passes per reader per round")
    p.add_argument("--segment-mib", type=int, default=0,
                   help="the pool node's DRAM segment (0: 3x the payload, room for both sides' objects)")
    p.add_argument("--protocol", choices=["tcp", "rdma"], default="tcp")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "pool_throughput.json"))
    a = p.parse_args(argv)
    if min(a.block_bytes, a.chunk_blocks, a.total_mib, a.threads, a.batch, a.repeats, a.load_passes) <= 0:
        p.error("sizes, --threads, --batch and --repeats must be positive")
    return a


class Workload:
    """The chunks of one phase; every block carries its global index in its first 8 bytes."""

    def __init__(self, total_bytes: int, block_bytes: int, chunk_blocks: int) -> None:
        self.block_bytes, self.chunk_blocks = block_bytes, chunk_blocks
        self.chunk_bytes = block_bytes * chunk_blocks
        self.nchunks = max(1, total_bytes // self.chunk_bytes)
        self.nblocks = self.nchunks * chunk_blocks
        self.payload_bytes = self.nblocks * block_bytes
        # Random-looking bytes, not zeros (a transport could special-case zeros).
        self.pattern = (os.urandom(1 << 16) * (-(-block_bytes // (1 << 16))))[:block_bytes]

    def block(self, b: int) -> bytes:
        return struct.pack("<Q", b) + self.pattern[8:]

    def keys(self, c: int) -> list[bytes]:
        return [struct.pack("<QQ", 0xB0, c * self.chunk_blocks + i) for i in range(self.chunk_blocks)]

    def write_buffer(self, c: int) -> WriteBuffer:
        wb = WriteBuffer(self.keys(c), self.block_bytes)
        for i in range(self.chunk_blocks):
            with wb.block(i) as dst:
                dst[:] = self.block(c * self.chunk_blocks + i)
        return wb


class Region:
    """Page-aligned anonymous memory with its address (for register_buffer)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align_up(nbytes)
        self.map = mmap.mmap(-1, self.nbytes)
        anchor = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(anchor)
        del anchor

    def tag(self, off: int) -> int:
        return struct.unpack_from("<Q", self.map, off)[0]


# ---- the pool node --------------------------------------------------------------------------


def pool_node(conn: Connection, master: str, segment_bytes: int, protocol: str) -> None:
    """A client that only contributes DRAM to the pool (runs in its own process)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, 16 * MiB, protocol, "", master)
    conn.send(rc)
    try:
        conn.recv()  # anything, or EOF when the parent is gone
    except EOFError:
        pass
    finally:
        client.close()


# ---- ours -------------------------------------------------------------------------------------


def poll_all(store: MooncakeStore, n: int, on_result: Any) -> None:
    done = 0
    while done < n:
        res = store.poll()
        for r in res:
            done += 1
            on_result(r)
        if not res:
            store.wait(0.001)


def ours_store(store: MooncakeStore, w: Workload, ids: list[str]) -> tuple[float, dict[str, ChunkHeader]]:
    bufs = [w.write_buffer(c) for c in range(w.nchunks)]
    headers: dict[str, ChunkHeader] = {}
    failed: list[str] = []

    def on_result(r: Any) -> None:
        if r.ok and r.header is not None:
            headers[r.chunk_id] = r.header
        else:
            failed.append(f"{r.chunk_id}: {r.reason}")

    t0 = time.perf_counter()
    for c, wb in enumerate(bufs):
        if not store.submit_write(c, ids[c], wb):
            raise RuntimeError("write queue full: raise max_queued_writes")
    poll_all(store, w.nchunks, on_result)
    secs = time.perf_counter() - t0
    if failed:
        raise RuntimeError(f"{len(failed)} writes failed, e.g. {failed[:3]}")
    return secs, headers


def ours_load(store: MooncakeStore, w: Workload, ids: list[str], headers: dict[str, ChunkHeader] | None) -> float:
    positions = list(range(w.chunk_blocks))
    failed: list[str] = []
    wrong = 0

    def on_result(r: Any) -> None:
        nonlocal wrong
        if not r.ok:
            failed.append(f"{r.chunk_id}: {r.reason}")
            return
        for i, b in enumerate(r.blocks or []):  # CRCs are verified by the store; the tag says which block
            wrong += struct.unpack_from("<Q", b, 0)[0] != r.job_id * w.chunk_blocks + i
        r.release()

    t0 = time.perf_counter()
    for c, oid in enumerate(ids):
        store.submit_read(c, oid, headers[oid] if headers is not None else None, positions, w.keys(c))
    poll_all(store, w.nchunks, on_result)
    secs = time.perf_counter() - t0
    if failed or wrong:
        raise RuntimeError(f"reads: {len(failed)} failed (e.g. {failed[:3]}), {wrong} wrong blocks")
    return secs


def ours_delete(store: MooncakeStore, ids: list[str]) -> None:
    for oid in ids:
        store.submit_delete(oid)
    bad: list[str] = []
    poll_all(store, len(ids), lambda r: None if r.ok else bad.append(r.reason))
    if bad:
        print(f"  warning: {len(bad)} deletes failed ({bad[:3]})", flush=True)


# ---- plain Mooncake ---------------------------------------------------------------------------


def batches(n: int, size: int) -> list[range]:
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def plain_store(client: Any, w: Workload, keys: list[str], src: Region, pool: ThreadPoolExecutor, batch: int,
                replicate: Any) -> float:
    def put(r: range) -> list[int]:
        return client.batch_put_from([keys[c] for c in r], [src.addr + c * w.chunk_bytes for c in r],
                                     [w.chunk_bytes] * len(r), replicate)

    t0 = time.perf_counter()
    rcs = [rc for part in pool.map(put, batches(w.nchunks, batch)) for rc in part]
    secs = time.perf_counter() - t0
    if any(rc != 0 for rc in rcs):
        raise RuntimeError(f"plain batch_put_from: {sum(rc != 0 for rc in rcs)} failed, codes {sorted(set(rcs))}")
    return secs


def plain_load(client: Any, w: Workload, keys: list[str], dst: Region, pool: ThreadPoolExecutor, batch: int) -> float:
    for b in range(w.nblocks):  # clear the tags: a read that did not land must not pass
        struct.pack_into("<Q", dst.map, b * w.block_bytes, 0xFFFFFFFFFFFFFFFF)

    def get(r: range) -> list[int]:
        return client.batch_get_into([keys[c] for c in r], [dst.addr + c * w.chunk_bytes for c in r],
                                     [w.chunk_bytes] * len(r))

    t0 = time.perf_counter()
    rcs = [rc for part in pool.map(get, batches(w.nchunks, batch)) for rc in part]
    secs = time.perf_counter() - t0
    wrong = sum(dst.tag(b * w.block_bytes) != b for b in range(w.nblocks))
    if any(rc != w.chunk_bytes for rc in rcs) or wrong:
        raise RuntimeError(f"plain batch_get_into: codes {sorted(set(rcs))[:5]}, {wrong} wrong blocks")
    return secs


# ---- main -------------------------------------------------------------------------------------


def one_round(store: MooncakeStore, client: Any, replicate: Any, w: Workload, a: argparse.Namespace, tag: int,
              src: Region, dst: Region, pool: ThreadPoolExecutor) -> dict[str, Any]:
    order = ("ours", "plain") if tag % 2 == 0 else ("plain", "ours")
    ids = [f"r{tag:02d}c{c:05d}" for c in range(w.nchunks)]
    keys = [f"bench/plain/r{tag:02d}/{c:05d}" for c in range(w.nchunks)]
    rec: dict[str, Any] = {"order": list(order), "load_pass_s": {r: [] for r in READERS}}
    before = store.stats().requests
    headers: dict[str, ChunkHeader] = {}
    for who in order:
        if who == "ours":
            rec["ours_store_s"], headers = ours_store(store, w, ids)
        else:
            rec["plain_store_s"] = plain_store(client, w, keys, src, pool, a.batch, replicate)
    for p in range(a.load_passes):
        k = (tag + p) % len(READERS)
        for who in READERS[k:] + READERS[:k]:
            if who == "plain":
                secs = plain_load(client, w, keys, dst, pool, a.batch)
            else:
                secs = ours_load(store, w, ids, headers if who == "ours" else None)
            rec["load_pass_s"][who].append(secs)
    rec["ours_requests"] = {k: v - before.get(k, 0) for k, v in store.stats().requests.items()
                            if v - before.get(k, 0)}
    ours_delete(store, ids)
    rcs = client.batch_remove(keys, force=True)
    if any(rc not in (0, -704) for rc in rcs):
        print(f"  warning: plain batch_remove codes {sorted(set(rcs))}", flush=True)
    rec["ours_load_s"] = statistics.mean(rec["load_pass_s"]["ours"])
    rec["ours-pd_load_s"] = statistics.mean(rec["load_pass_s"]["ours-pd"])
    rec["plain_load_s"] = statistics.mean(rec["load_pass_s"]["plain"])
    return rec


def mooncake_version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return "?"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    w = Workload(a.total_mib * MiB, a.block_bytes, a.chunk_blocks)
    object_bytes = header_bytes_for(w.chunk_blocks) + w.chunk_blocks * align_up(w.block_bytes)
    segment = a.segment_mib * MiB or 3 * w.nchunks * object_bytes + 64 * MiB
    t_all = time.perf_counter()
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-pool-bench-")))
        master = MooncakeMaster(logs)
        master.start()
        stack.callback(master.stop)
        ctx = mp.get_context("spawn")
        ours_end, node_end = ctx.Pipe()
        node = ctx.Process(target=pool_node, args=(node_end, master.address, segment, a.protocol), daemon=True)
        node.start()

        def stop_node() -> None:
            with contextlib.suppress(OSError):
                ours_end.send("exit")
            node.join(30)
            if node.is_alive():
                node.kill()

        stack.callback(stop_node)
        if not ours_end.poll(120) or ours_end.recv() != 0:
            raise RuntimeError(f"the pool node did not join the pool: {master.log_tail()}")

        # Ours: a pure client (no segment), arena large enough for every read of a pass in flight.
        cfg = MooncakeConfig(master=master.address, local_hostname="127.0.0.1", protocol=a.protocol,
                             global_segment_bytes=0, local_buffer_bytes=16 * MiB,
                             transfer_buffer_bytes=w.nchunks * align_up(object_bytes) + 16 * MiB,
                             deadline_s=120.0, io_threads=a.threads, max_batch=a.batch,
                             max_queued_writes=w.nchunks)
        store = MooncakeStore(cfg, StoreContext(NAMESPACE, 0, w.block_bytes), max_chunk_blocks=w.chunk_blocks)
        stack.callback(store.close)

        # Plain: the same kind of client, two registered buffers (source and destination).
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        client = MooncakeDistributedStore()
        rc = client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, a.protocol, "", master.address)
        if rc != 0:
            raise RuntimeError(f"plain client setup failed (rc {rc})")
        stack.callback(client.close)
        src, dst = Region(w.payload_bytes), Region(w.payload_bytes)
        for c in range(w.nchunks):
            for i in range(w.chunk_blocks):
                b = c * w.chunk_blocks + i
                src.map[b * w.block_bytes : (b + 1) * w.block_bytes] = w.block(b)
        for r in (src, dst):
            if client.register_buffer(r.addr, r.nbytes) != 0:
                raise RuntimeError("plain client: register_buffer failed")
        # Long-lived threads, like the store's I/O threads.
        pool = stack.enter_context(ThreadPoolExecutor(a.threads, thread_name_prefix="plain-mooncake"))
        replicate = ReplicateConfig()
        replicate.replica_num = cfg.replicas
        print(f"mooncake_master {master.address}, pool node pid {node.pid} with a {segment / MiB:.0f} MiB segment, "
              f"{a.protocol}; {w.nchunks} objects x {w.chunk_blocks} blocks x {w.block_bytes} B = "
              f"{w.payload_bytes / MiB:.0f} MiB per phase; {a.threads} threads, batches of {a.batch}; "
              f"CRC32 {CRC_IMPL}; {a.repeats} rounds x {a.load_passes} load passes", flush=True)

        rounds = []
        for i in range(a.repeats):
            rec = one_round(store, client, replicate, w, a, i, src, dst, pool)
            rounds.append(rec)

            def mbps(s: float) -> str:
                return f"{w.payload_bytes / s / MB:.0f}"

            print(f"  round {i + 1} ({'/'.join(rec['order'])} first): store ours {mbps(rec['ours_store_s'])} "
                  f"plain {mbps(rec['plain_store_s'])} MB/s; load ours {mbps(rec['ours_load_s'])} "
                  f"ours-pd {mbps(rec['ours-pd_load_s'])} plain {mbps(rec['plain_load_s'])} MB/s", flush=True)
        for r in (src, dst):
            client.unregister_buffer(r.addr)
        stats = store.stats()
        t_close = time.perf_counter()
    close_s = time.perf_counter() - t_close

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rounds)

    cases = []
    for case, ours_k, plain_k, what in (
        ("store", "ours_store_s", "plain_store_s", "submit_write vs batch_put_from"),
        ("load", "ours_load_s", "plain_load_s", "submit_read(header) vs batch_get_into"),
        ("load-pd", "ours-pd_load_s", "plain_load_s", "submit_read(None) vs batch_get_into"),
    ):
        ours, plain = w.payload_bytes / med(ours_k) / MB, w.payload_bytes / med(plain_k) / MB
        cases.append({"case": case, "what": what, "bytes": w.payload_bytes, "ours_MBps": ours, "plain_MBps": plain,
                      "ratio": ours / plain,
                      "paired_ratio": statistics.median(r[plain_k] / r[ours_k] for r in rounds)})

    print()
    print(f"{'case':<8} {'bytes':>10} {'ours MB/s':>10} {'plain MB/s':>11} {'ratio':>6} {'paired':>7}  what")
    for c in cases:
        print(f"{c['case']:<8} {c['bytes']:>10} {c['ours_MBps']:>10.0f} {c['plain_MBps']:>11.0f} "
              f"{c['ratio']:>6.2f} {c['paired_ratio']:>7.2f}  {c['what']}")
    print("(ratio = ours/plain of the median MB/s; paired = median over rounds of ours/plain within a round;")
    print(f" ours' requests in round 1: {rounds[0]['ours_requests']})")
    targets = {f"{c['case']}_throughput_ratio_ge_{TARGET}": c["ratio"] >= TARGET for c in cases}
    for name, ok in targets.items():
        print(f"target {name}: {'PASS' if ok else 'FAIL'}")
    total = time.perf_counter() - t_all
    print(f"total {total:.0f}s (leaving the pool {close_s:.1f}s), load avg {os.getloadavg()[0]:.2f}")

    result = {
        "benchmark": "pool_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(a),
        "pool": {"master": master.address, "segment_bytes": segment, "protocol": a.protocol,
                 "layout": "a separate pool-node process hosts the only segment; both clients have none"},
        "payload_bytes_per_phase": w.payload_bytes, "objects": w.nchunks, "object_bytes_ours": object_bytes,
        "crc_impl": CRC_IMPL, "throughput": cases, "targets": targets, "rounds": rounds,
        "ours_stats": {"requests": stats.requests, "failures": stats.failures},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "mooncake": mooncake_version(), "loadavg_end": os.getloadavg(), "total_s": total},
    }
    save_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
