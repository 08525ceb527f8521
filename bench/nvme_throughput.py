"""Throughput of the NVMe tier (``NVMeStore``) against ``dd`` with O_DIRECT on the same disk.

What it measures, in one run, on one directory, for the same number of payload bytes
(``--total-mib``), alternating ours and the reference round after round (``--repeats``;
the order flips every round so drift in the machine's load does not favour one side):

* ``write``: the total as chunk files of ``--chunk-blocks`` blocks of ``--block-bytes``
  through ``NVMeStore.submit_write`` with its I/O threads kept busy (submit until refused,
  poll, resubmit); wall time from the first submit until every write completed. Each write
  is: CRC32 of every block, header, pwrite (O_DIRECT when the filesystem allows it),
  fdatasync, rename, directory fsync. The chunk buffers are filled before the clock starts
  (the caller's copy into them is measured by the CPU-tier benchmark); the row
  ``write+fill`` includes that fill (a memcpy into fresh page-aligned buffers) as well.
* ``read``: every block back, one ``submit_read`` per whole chunk, checksums verified by
  the store; wall time until every read completed (buffers released as they arrive).
* reference: ``dd if=/dev/zero of=FILE bs=<chunk payload bytes> count=<chunks> oflag=direct
  conv=fdatasync`` and ``dd if=FILE of=/dev/null bs=<chunk payload bytes> iflag=direct``.
  The time is dd's own "copied, X s" (it excludes process start-up and the file's
  creation, so it is the stricter reference); the subprocess wall time is kept in the JSON.

MB/s = payload bytes (blocks only; our files also carry a 4 KiB header each) / seconds,
MB = 1e6 bytes. Before each read phase the page cache is dropped if allowed (``sync; echo 3
> /proc/sys/vm/drop_caches``; inside a container this usually fails, which is recorded);
with O_DIRECT the page cache is not used anyway.

Index rebuild: ``scan_dir`` on a directory with ``--index-blocks`` blocks' worth of chunk
files (``--index-block-bytes`` per block, 16 blocks per file), which is what the scheduler
does at start-up. The files are made cheaply (header written, then ``ftruncate`` to the
full size, so the data is sparse; ``scan_dir`` only reads headers and ``fstat``), then
synced and their pages evicted with ``posix_fadvise(DONTNEED)``: the first scan reads the
headers from disk (directory entries and inodes may still be cached unless drop_caches
works), the second is fully warm.

    python bench/nvme_throughput.py                       # 1 GiB, 5 rounds, 100k-block index
    python bench/nvme_throughput.py --dir /mnt/nvme/tmp --total-mib 4096
    python bench/nvme_throughput.py --sweep               # also try io_threads / chunk sizes
    python bench/nvme_throughput.py --auth                # also with MACs (auth), paired on/off

``--auth``: every round also writes and reads the same workload through a second store that
signs and verifies every chunk (``auth``, HMAC-SHA256 of every block and the header, a
random key), interleaved with the unauthenticated one (the order flips every round); the
rows ``write(auth)`` / ``read(auth)`` and the JSON's ``auth`` give the MAC-on/MAC-off ratio.

The data directory is a fresh subdirectory of ``--dir`` (default a new temp dir under
/var/tmp, i.e. the real disk rather than tmpfs) and is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.stores import nvme_section  # noqa: E402
from vllm_kvtier.chunkformat import (  # noqa: E402
    align_up,
    block_crc,
    encode_header,
    header_bytes_for,
    make_header,
)
from vllm_kvtier.config import NVMeTierConfig  # noqa: E402
from vllm_kvtier.tiers.auth import ChunkAuth  # noqa: E402
from vllm_kvtier.tiers.base import IOResult  # noqa: E402
from vllm_kvtier.tiers.buffers import WriteBuffer  # noqa: E402
from vllm_kvtier.tiers.nvme.store import NVMeStore, scan_dir  # noqa: E402
from vllm_kvtier.tiers.registry import StoreContext  # noqa: E402

MB = 1e6
MiB = 1 << 20
NAMESPACE = "benchnvme0000000"  # 16 ASCII chars, as the real namespace digest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None,
                   help="parent directory for the data (default: a new temp dir under /var/tmp); "
                        "a fresh subdirectory is made in it and removed at the end")
    p.add_argument("--total-mib", type=int, default=1024, help="payload bytes per phase, MiB")
    p.add_argument("--block-bytes", type=int, default=2 * MiB,
                   help="bytes per KV block (default 2 MiB: Llama-3-8B, 16 tokens, bf16, one rank)")
    p.add_argument("--chunk-blocks", type=int, default=16, help="blocks per chunk file")
    p.add_argument("--io-threads", type=int, default=NVMeTierConfig.io_threads)
    p.add_argument("--max-queued-writes", type=int, default=64)
    p.add_argument("--direct-io", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--index-blocks", type=int, default=100_000,
                   help="blocks' worth of chunk files for the index-rebuild (scan_dir) timing; 0 = skip")
    p.add_argument("--index-block-bytes", type=int, default=4096)
    p.add_argument("--index-chunk-blocks", type=int, default=16)
    p.add_argument("--no-fill-row", action="store_true", help="skip the write+fill row")
    p.add_argument("--auth", action="store_true",
                   help="also run every round through a store with MACs on (auth) and report the on/off ratio")
    p.add_argument("--sweep", action="store_true",
                   help="also time ours (write+read, one round each) for io_threads in {1,2,4} "
                        "and chunk-blocks in {4,16,64} (informational, no dd)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "nvme_throughput.json"))
    a = p.parse_args(argv)
    if a.block_bytes <= 0 or a.chunk_blocks <= 0 or a.total_mib <= 0 or a.repeats <= 0:
        p.error("sizes and --repeats must be positive")
    return a


# ---- helpers -------------------------------------------------------------------------

def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def fs_type(path: Path) -> dict[str, str]:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        fields = out.strip().splitlines()[-1].split()
        return {"device": fields[0], "type": fields[1], "mount": fields[-1], "df_T": out.strip()}
    except (OSError, subprocess.CalledProcessError, IndexError) as e:
        return {"type": "unknown", "error": str(e)}


def drop_caches() -> str:
    """sync; echo 3 > drop_caches. Returns 'ok' or why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "ok"
    except OSError as e:
        return f"failed: {e.strerror}"


class Workload:
    """The chunks of one phase: keys, file ids and a block pattern with a per-block tag."""

    def __init__(self, total_bytes: int, block_bytes: int, chunk_blocks: int, tag: int) -> None:
        self.block_bytes = block_bytes
        self.chunk_blocks = chunk_blocks
        self.nblocks = max(1, total_bytes // block_bytes)
        self.nchunks = -(-self.nblocks // chunk_blocks)
        self.nblocks = self.nchunks * chunk_blocks  # whole chunks only
        self.payload_bytes = self.nblocks * block_bytes
        # Random-looking bytes (not zeros: a filesystem/device could special-case zeros),
        # the same pattern for every block except an 8-byte tag at the start.
        self.pattern = (os.urandom(min(block_bytes, 1 << 16)) * (-(-block_bytes // (1 << 16))))[:block_bytes]
        self.tag = tag
        self.chunk_ids = [f"{tag:08x}{c:08x}" for c in range(self.nchunks)]

    def keys(self, c: int) -> list[bytes]:
        return [struct.pack("<QQ", self.tag, c * self.chunk_blocks + i) for i in range(self.chunk_blocks)]

    def make_buffer(self, c: int, authenticated: bool = False) -> WriteBuffer:
        wb = WriteBuffer(self.keys(c), self.block_bytes, authenticated=authenticated)
        for i in range(self.chunk_blocks):
            blk = wb.block(i)
            blk[:] = self.pattern
            blk[:8] = struct.pack("<Q", c * self.chunk_blocks + i)
            blk.release()
        return wb


def poll_wait(store: NVMeStore) -> list[IOResult]:
    res = store.poll()
    if not res:
        time.sleep(0.0005)
    return res


def time_ours_write(store: NVMeStore, w: Workload, prefill: bool) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """Submit every chunk (until refused, poll, resubmit); returns (seconds, headers, stats)."""
    bufs: list[WriteBuffer | None] | None = (
        [w.make_buffer(c, store.authenticated) for c in range(w.nchunks)] if prefill else None)
    headers: dict[str, Any] = {}
    refused = 0
    failed: list[str] = []
    busy_s = 0.0
    nxt, done = 0, 0
    pending: WriteBuffer | None = None
    c0 = time.process_time()
    t0 = time.perf_counter()
    while done < w.nchunks:
        while nxt < w.nchunks:
            if pending is None:
                pending = bufs[nxt] if bufs is not None else None
                pending = pending or w.make_buffer(nxt, store.authenticated)
            if not store.submit_write(nxt, w.chunk_ids[nxt], pending):
                refused += 1
                break
            if bufs is not None:
                bufs[nxt] = None
            pending = None
            nxt += 1
        for r in poll_wait(store):
            done += 1
            busy_s += r.seconds
            if r.ok:
                headers[r.chunk_id] = r.header
            else:
                failed.append(f"{r.chunk_id}: {r.reason}")
    secs = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if failed:
        raise RuntimeError(f"{len(failed)} writes failed, e.g. {failed[:3]}")
    return secs, headers, {"refused": refused, "thread_busy_s": busy_s, "cpu_s": cpu}


def time_ours_read(store: NVMeStore, w: Workload, headers: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    positions = list(range(w.chunk_blocks))
    failed: list[str] = []
    busy_s = 0.0
    bad_tag = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    for c, fid in enumerate(w.chunk_ids):
        store.submit_read(c, fid, headers[fid], positions, [headers[fid].keys[p] for p in positions])
    done = 0
    while done < w.nchunks:
        for r in poll_wait(store):
            done += 1
            busy_s += r.seconds
            if not r.ok:
                failed.append(f"{r.chunk_id}: {r.reason}")
                continue
            # The store verified every CRC; check the tag too (the right block came back).
            for i, b in enumerate(r.blocks or []):
                if struct.unpack_from("<Q", b, 0)[0] != r.job_id * w.chunk_blocks + i:
                    bad_tag += 1
            r.release()
    secs = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if failed or bad_tag:
        raise RuntimeError(f"reads: {len(failed)} failed (e.g. {failed[:3]}), {bad_tag} wrong blocks")
    return secs, {"thread_busy_s": busy_s, "cpu_s": cpu}


def delete_ours(store: NVMeStore, w: Workload) -> None:
    for fid in w.chunk_ids:
        with contextlib.suppress(FileNotFoundError):
            store.path(fid).unlink()


_DD_SECS = re.compile(r"copied,\s*([0-9.eE+-]+)\s*s")


def run_dd(args: list[str]) -> tuple[float, float, str]:
    """Run dd; returns (dd's own seconds, subprocess wall seconds, dd's summary line)."""
    t0 = time.perf_counter()
    p = subprocess.run(["dd", *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"dd {' '.join(args)} failed: {p.stderr.strip()}")
    line = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    m = _DD_SECS.search(line)
    return (float(m.group(1)) if m else wall), wall, line


def time_dd_write(path: Path, chunk_bytes: int, count: int) -> tuple[float, float, str]:
    return run_dd(["if=/dev/zero", f"of={path}", f"bs={chunk_bytes}", f"count={count}",
                   "oflag=direct", "conv=fdatasync"])


def time_dd_read(path: Path, chunk_bytes: int) -> tuple[float, float, str]:
    return run_dd([f"if={path}", "of=/dev/null", f"bs={chunk_bytes}", "iflag=direct"])


# ---- index rebuild ---------------------------------------------------------------------

def make_index_dir(d: Path, nblocks: int, block_bytes: int, chunk_blocks: int) -> int:
    """Chunk files for ``nblocks`` blocks: real headers, sparse data. Returns the file count."""
    d.mkdir(parents=True, exist_ok=True)
    crc0 = block_crc(bytes(block_bytes))
    nfiles = -(-nblocks // chunk_blocks)
    for f in range(nfiles):
        n = min(chunk_blocks, nblocks - f * chunk_blocks)
        keys = [struct.pack("<QQ", 0xC0FFEE, f * chunk_blocks + i) for i in range(n)]
        h = make_header(NAMESPACE, keys, [crc0] * n, block_bytes)
        head = bytearray(h.header_bytes)
        encode_header(h, memoryview(head))
        fd = os.open(d / f"{f:016x}-idx.kvt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, head)
            # Real bytes, not a sparse file: the store refuses a chunk with holes
            # ("truncated") without reading it, so a sparse index would scan as empty.
            os.write(fd, bytes(h.total_bytes - h.header_bytes))
        finally:
            os.close(fd)
    os.sync()
    for e in os.scandir(d):  # evict the headers' pages (clean after sync)
        fd = os.open(e.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return nfiles


def time_index(d: Path, a: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    nfiles = make_index_dir(d, a.index_blocks, a.index_block_bytes, a.index_chunk_blocks)
    make_s = time.perf_counter() - t0
    dc = drop_caches()
    out: dict[str, Any] = {"blocks": a.index_blocks, "files": nfiles, "block_bytes": a.index_block_bytes,
                              "chunk_blocks": a.index_chunk_blocks, "create_s": make_s, "drop_caches": dc}
    for label in ("cold", "warm"):
        t0 = time.perf_counter()
        found, problems = scan_dir(d, NAMESPACE)
        secs = time.perf_counter() - t0
        nb = sum(h.nblocks for h in found.values())
        if len(found) != nfiles or nb != a.index_blocks or problems:
            raise RuntimeError(f"scan_dir found {len(found)} files / {nb} blocks, problems {problems}")
        out[f"scan_{label}_s"] = secs
    out["scan_per_100k_blocks_cold_s"] = out["scan_cold_s"] * 100_000 / a.index_blocks
    out["scan_per_100k_blocks_warm_s"] = out["scan_warm_s"] * 100_000 / a.index_blocks
    return out


# ---- main ------------------------------------------------------------------------------

def one_round_ours(store: NVMeStore, w: Workload, fill_row: bool) -> dict[str, Any]:
    r: dict[str, Any] = {}
    secs, headers, st = time_ours_write(store, w, prefill=True)
    r["write_s"], r["write_refused"], r["write_thread_busy_s"] = secs, st["refused"], st["thread_busy_s"]
    r["write_cpu_s"] = st["cpu_s"]
    r["drop_caches"] = drop_caches()
    secs, st = time_ours_read(store, w, headers)
    r["read_s"], r["read_thread_busy_s"], r["read_cpu_s"] = secs, st["thread_busy_s"], st["cpu_s"]
    delete_ours(store, w)
    if fill_row:
        secs, _, st = time_ours_write(store, w, prefill=False)
        r["write_fill_s"], r["write_fill_cpu_s"] = secs, st["cpu_s"]
        delete_ours(store, w)
    return r


def one_round_dd(path: Path, w: Workload) -> dict[str, Any]:
    chunk_bytes = w.chunk_blocks * w.block_bytes
    r: dict[str, Any] = {}
    r["write_s"], r["write_wall_s"], r["write_line"] = time_dd_write(path, chunk_bytes, w.nchunks)
    r["drop_caches"] = drop_caches()
    r["read_s"], r["read_wall_s"], r["read_line"] = time_dd_read(path, chunk_bytes)
    path.unlink()
    return r


def sweep(base: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    total = a.total_mib * MiB
    for threads, cb in [(1, 16), (2, 16), (4, 16), (2, 4), (2, 64), (4, 64)]:
        d = base / f"sweep-t{threads}-c{cb}"
        store = NVMeStore(nvme_section(d, direct_io=a.direct_io, io_threads=threads,
                                       max_queued_writes=a.max_queued_writes),
                          StoreContext(NAMESPACE, 0, a.block_bytes))
        try:
            w = Workload(total, a.block_bytes, cb, tag=0x5EE9)
            ws, headers, _ = time_ours_write(store, w, prefill=True)
            rs, _ = time_ours_read(store, w, headers)
            delete_ours(store, w)
        finally:
            store.close()
        rows.append({"io_threads": threads, "chunk_blocks": cb, "write_MBps": w.payload_bytes / ws / MB,
                     "read_MBps": w.payload_bytes / rs / MB})
        print(f"  sweep io_threads={threads} chunk_blocks={cb:3d}: write {rows[-1]['write_MBps']:7.0f} MB/s, "
              f"read {rows[-1]['read_MBps']:7.0f} MB/s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    load_before = _loadavg()
    if a.dir is None:
        parent = Path("/var/tmp")
    else:
        parent = Path(a.dir)
        parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="kvtier-nvme-bench-", dir=parent))
    fs = fs_type(base)
    try:
        section = nvme_section(base / "store", direct_io=a.direct_io, io_threads=a.io_threads,
                               max_queued_writes=a.max_queued_writes)
        store = NVMeStore(section, StoreContext(NAMESPACE, 0, a.block_bytes))
        auth_store = (NVMeStore(dataclasses.replace(section, path=str(base / "store-auth")),
                                StoreContext(NAMESPACE, 0, a.block_bytes, auth=ChunkAuth(os.urandom(32))))
                      if a.auth else None)
        w = Workload(a.total_mib * MiB, a.block_bytes, a.chunk_blocks, tag=0xB10C)
        dd_path = base / "dd.bin"
        print(f"dir {base} ({fs.get('type')} on {fs.get('device')}), O_DIRECT: {store.direct}, "
              f"{w.nchunks} chunks x {w.chunk_blocks} blocks x {w.block_bytes} B = "
              f"{w.payload_bytes / MiB:.0f} MiB per phase, io_threads={a.io_threads}, "
              f"loadavg {load_before}", flush=True)
        rounds = []
        try:
            for i in range(a.repeats):
                order: tuple[str, ...] = ("ours", "dd") if i % 2 == 0 else ("dd", "ours")
                if auth_store is not None:  # MAC on right before or after MAC off, alternating
                    order = ("ours", "auth", "dd") if i % 2 == 0 else ("dd", "auth", "ours")
                rec: dict[str, Any] = {"order": list(order)}
                for who in order:
                    if who == "ours":
                        rec[who] = one_round_ours(store, w, not a.no_fill_row)
                    elif who == "auth":
                        assert auth_store is not None
                        rec[who] = one_round_ours(auth_store, w, False)
                    else:
                        rec[who] = one_round_dd(dd_path, w)
                rounds.append(rec)
                o, d = rec["ours"], rec["dd"]
                print(f"  round {i + 1} ({'/'.join(order)}): write ours {w.payload_bytes / o['write_s'] / MB:.0f} "
                      f"dd {w.payload_bytes / d['write_s'] / MB:.0f} MB/s; read ours "
                      f"{w.payload_bytes / o['read_s'] / MB:.0f} dd {w.payload_bytes / d['read_s'] / MB:.0f} MB/s",
                      flush=True)
            direct = store.direct
        finally:
            store.close()
            if auth_store is not None:
                auth_store.close()

        def med(who: str, key: str) -> float:
            return statistics.median(r[who][key] for r in rounds)

        cases = []
        for case, okey, dkey in [("write", "write_s", "write_s"), ("read", "read_s", "read_s")] + (
                [] if a.no_fill_row else [("write+fill", "write_fill_s", "write_s")]):
            ours = w.payload_bytes / med("ours", okey) / MB
            dd = w.payload_bytes / med("dd", dkey) / MB
            ckey = okey.replace("_s", "_cpu_s")
            cases.append({"case": case, "bytes": w.payload_bytes, "ours_MBps": ours, "dd_MBps": dd,
                          "ratio": ours / dd,
                          # dd time / ours time of the same round (adjacent in time), median over rounds
                          "paired_ratio": statistics.median(r["dd"][dkey] / r["ours"][okey] for r in rounds),
                          "ours_median_s": med("ours", okey), "dd_median_s": med("dd", dkey),
                          "ours_cpu_s": med("ours", ckey)})

        auth_rows = None
        if auth_store is not None:
            auth_rows = []
            for case, key in (("write", "write_s"), ("read", "read_s")):
                on, off = w.payload_bytes / med("auth", key) / MB, w.payload_bytes / med("ours", key) / MB
                auth_rows.append({"case": f"{case}(auth)", "auth_MBps": on, "plain_MBps": off, "ratio": on / off,
                                  "paired_ratio": statistics.median(r["ours"][key] / r["auth"][key] for r in rounds),
                                  "auth_cpu_s": med("auth", key.replace("_s", "_cpu_s")),
                                  "plain_cpu_s": med("ours", key.replace("_s", "_cpu_s"))})

        sweep_rows = sweep(base, a) if a.sweep else None
        index = time_index(base / "index", a) if a.index_blocks > 0 else None
        load_after = _loadavg()

        print()
        print(f"{'case':<12} {'bytes':>12} {'ours MB/s':>10} {'dd MB/s':>10} {'ratio':>6} {'paired':>7} "
              f"{'ours CPU s':>10}")
        for c in cases:
            print(f"{c['case']:<12} {c['bytes']:>12} {c['ours_MBps']:>10.0f} {c['dd_MBps']:>10.0f} {c['ratio']:>6.2f} "
                  f"{c['paired_ratio']:>7.2f} {c['ours_cpu_s']:>10.2f}")
        print("(ratio = ours/dd of the median MB/s; paired = median over rounds of ours/dd within a round; "
              "ours CPU s = process CPU time, all threads, median)")
        if auth_rows:
            print()
            print(f"{'case':<12} {'MAC on MB/s':>12} {'MAC off MB/s':>13} {'ratio':>6} {'paired':>7} "
                  f"{'CPU s on/off':>14}")
            for c in auth_rows:
                print(f"{c['case']:<12} {c['auth_MBps']:>12.0f} {c['plain_MBps']:>13.0f} {c['ratio']:>6.2f} "
                      f"{c['paired_ratio']:>7.2f} {c['auth_cpu_s']:>6.2f}/{c['plain_cpu_s']:.2f}")
            print("(auth: HMAC-SHA256 of every block and header on write, verified on read; ratio = on/off)")
        by = {c["case"]: c for c in cases}
        print()
        for case in ("write", "read"):
            r = by[case]["ratio"]
            print(f"target: {case} ratio >= 0.8: {r:.2f} {'PASS' if r >= 0.8 else 'FAIL'}")
        if index:
            print(f"index rebuild (scan_dir): {index['blocks']} blocks in {index['files']} files: "
                  f"{index['scan_cold_s']:.3f} s (headers not in page cache), {index['scan_warm_s']:.3f} s warm; "
                  f"per 100k blocks {index['scan_per_100k_blocks_cold_s']:.3f} s / "
                  f"{index['scan_per_100k_blocks_warm_s']:.3f} s (drop_caches: {index['drop_caches']})")
        print(f"O_DIRECT: {direct}; filesystem: {fs.get('type')} ({fs.get('device')} on {fs.get('mount')}); "
              f"medians of {a.repeats} rounds, dd time = dd's own; drop_caches: {rounds[0]['ours']['drop_caches']}")
        print(f"loadavg before: {load_before} | after: {load_after}")

        result = {
            "benchmark": "nvme_throughput",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "args": vars(a),
            "dir": str(base),
            "filesystem": fs,
            "o_direct": direct,
            "payload_bytes_per_phase": w.payload_bytes,
            "chunks": w.nchunks,
            "file_bytes_per_chunk": header_bytes_for(w.chunk_blocks) + w.chunk_blocks * align_up(w.block_bytes),
            "cases": cases,
            "targets": {f"{c}_ratio_ge_0.8": by[c]["ratio"] >= 0.8 for c in ("write", "read")},
            "rounds": rounds,
            "sweep": sweep_rows,
            "auth": auth_rows,
            "index_rebuild": index,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "loadavg_before": load_before,
                        "loadavg_after": load_after},
        }
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
            print(f"wrote {a.json}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
