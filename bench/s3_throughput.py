"""Throughput and request cost of the S3 tier (``S3Store``) against plain boto3, on one server.

What it measures, in one run against the same endpoint (a moto server this script starts
on 127.0.0.1, or ``--endpoint-url`` with credentials from the standard AWS chain):

* ``store`` / ``load`` throughput: ``--total-mib`` of payload as chunks of ``--chunk-blocks``
  blocks of ``--block-bytes``, through ``S3Store.submit_write`` / ``submit_read`` (every
  block of every chunk, CRC32s computed and verified), against plain boto3
  ``put_object`` / ``get_object(...)["Body"].read()`` of the same payload bytes, one object
  per chunk, from a thread pool of the same size as the store's I/O threads
  (``--threads``). Both use the same botocore settings (no SDK retries, no SDK checksums).
  Wall time from the first submit until every transfer completed; the chunk buffers and the
  baseline's bytes are made before the clock starts. Rounds alternate which side goes first
  (``--repeats``); then each side loads its objects ``--load-passes`` times, the sides
  alternating pass by pass (more bytes timed without more bytes stored, and drift in the
  machine's load hits both sides). The table shows medians and the ratio ours/boto3
  (target >= 0.9).
* requests per GiB stored and loaded: HTTP requests actually sent (counted on botocore's
  ``before-send`` event, every attempt) for the chunked store against plain boto3 storing
  and loading one object per block (the same payload; target: ours <= 1/10 of that).
* ``--auth``: a third side in every round, a store that signs and verifies every chunk
  (``auth``: HMAC-SHA256 of every block and the header, a random key), interleaved with
  the others; the table ``MAC on/off`` and the JSON's ``auth`` give the on/off ratio.

MB/s = payload bytes (blocks only; our objects also carry a 4 KiB header) / seconds, MB =
1e6 bytes. moto keeps objects in its process memory and does not give it back, so the
defaults stay small (64 MiB per phase); objects are deleted after each phase.

    python bench/s3_throughput.py                        # moto on 127.0.0.1, 64 MiB, 7 rounds
    python bench/s3_throughput.py --auth                 # also with MACs on (auth), paired on/off
    python bench/s3_throughput.py --endpoint-url https://s3.us-east-1.amazonaws.com \\
        --bucket my-bucket --total-mib 1024              # a real endpoint (bucket must exist)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import save_json  # noqa: E402
from testkit.s3_server import MotoServer, aws_test_env  # noqa: E402
from vllm_kvtier.chunkformat import ChunkHeader  # noqa: E402
from vllm_kvtier.tiers.auth import ChunkAuth  # noqa: E402
from vllm_kvtier.tiers.buffers import WriteBuffer  # noqa: E402
from vllm_kvtier.tiers.registry import StoreContext  # noqa: E402
from vllm_kvtier.tiers.s3.store import S3Config, S3Store  # noqa: E402

MB = 1e6
MiB = 1 << 20
GiB = 1 << 30
NAMESPACE = "benchs3000000000"  # 16 ASCII chars, as the real namespace digest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint-url", default=None, help="use this endpoint instead of starting moto")
    p.add_argument("--bucket", default="kvtier-bench", help="created if moto is started")
    p.add_argument("--prefix", default="bench/")
    p.add_argument("--path-style", action="store_true", help="(always on for the moto server)")
    p.add_argument("--total-mib", type=int, default=64, help="payload per phase, MiB (moto keeps it in RAM)")
    p.add_argument("--block-bytes", type=int, default=512 * 1024)
    p.add_argument("--chunk-blocks", type=int, default=16, help="blocks per object")
    p.add_argument("--threads", type=int, default=4, help="S3Store io_threads = boto3 baseline threads")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--load-passes", type=int, default=4,
                   help="each load phase reads every object this many times (more bytes timed, no more stored)")
    p.add_argument("--auth", action="store_true",
                   help="also run every round through a store with MACs on (auth) and report the on/off ratio")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "s3_throughput.json"))
    a = p.parse_args(argv)
    if min(a.block_bytes, a.chunk_blocks, a.total_mib, a.threads, a.repeats, a.load_passes) <= 0:
        p.error("sizes, --threads and --repeats must be positive")
    return a


class Workload:
    """The chunks of one phase; every block carries its global index in its first 8 bytes."""

    def __init__(self, total_bytes: int, block_bytes: int, chunk_blocks: int) -> None:
        self.block_bytes, self.chunk_blocks = block_bytes, chunk_blocks
        self.nchunks = max(1, total_bytes // (block_bytes * chunk_blocks))
        self.nblocks = self.nchunks * chunk_blocks
        self.payload_bytes = self.nblocks * block_bytes
        # Random-looking bytes, not zeros (a server could special-case zeros).
        self.pattern = (os.urandom(1 << 16) * (-(-block_bytes // (1 << 16))))[:block_bytes]

    def block(self, b: int) -> bytes:
        return struct.pack("<Q", b) + self.pattern[8:]

    def chunk_bytes(self, c: int) -> bytes:
        return b"".join(self.block(c * self.chunk_blocks + i) for i in range(self.chunk_blocks))

    def write_buffer(self, c: int, authenticated: bool = False) -> WriteBuffer:
        wb = WriteBuffer([struct.pack("<QQ", 0xB0, c * self.chunk_blocks + i) for i in range(self.chunk_blocks)],
                         self.block_bytes, authenticated=authenticated)
        for i in range(self.chunk_blocks):
            with wb.block(i) as dst:
                dst[:] = self.block(c * self.chunk_blocks + i)
        return wb


def counting(client: Any) -> dict[str, int]:
    """Count the HTTP requests a boto3 client sends, by operation (every attempt)."""
    counts: dict[str, int] = {}

    def hook(event_name: str = "", **_: Any) -> None:
        op = event_name.rsplit(".", 1)[-1]
        counts[op] = counts.get(op, 0) + 1

    client.meta.events.register("before-send.s3", hook)
    return counts


def total(d: dict[str, int]) -> int:
    return sum(d.values())


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


# ---- ours ---------------------------------------------------------------------------------


def ours_store(store: S3Store, w: Workload, ids: list[str]) -> tuple[float, dict[str, ChunkHeader]]:
    bufs = [w.write_buffer(c, store.authenticated) for c in range(w.nchunks)]
    headers: dict[str, ChunkHeader] = {}
    failed: list[str] = []
    t0 = time.perf_counter()
    for c, wb in enumerate(bufs):
        if not store.submit_write(c, ids[c], wb):
            raise RuntimeError("write queue full: raise max_queued_writes")
    done = 0
    while done < w.nchunks:
        res = store.poll()
        for r in res:
            done += 1
            if r.ok and r.header is not None:
                headers[r.chunk_id] = r.header
            else:
                failed.append(f"{r.chunk_id}: {r.reason}")
        if not res:
            time.sleep(0.0005)
    secs = time.perf_counter() - t0
    if failed:
        raise RuntimeError(f"{len(failed)} writes failed, e.g. {failed[:3]}")
    return secs, headers


def ours_load(store: S3Store, w: Workload, ids: list[str], headers: dict[str, ChunkHeader]) -> float:
    positions = list(range(w.chunk_blocks))
    failed, wrong = [], 0
    t0 = time.perf_counter()
    for c, oid in enumerate(ids):
        store.submit_read(c, oid, headers[oid], positions, [headers[oid].keys[p] for p in positions])
    done = 0
    while done < w.nchunks:
        res = store.poll()
        for r in res:
            done += 1
            if not r.ok:
                failed.append(f"{r.chunk_id}: {r.reason}")
                continue
            for i, b in enumerate(r.blocks or []):  # CRCs are verified by the store; the tag says which block
                wrong += struct.unpack_from("<Q", b, 0)[0] != r.job_id * w.chunk_blocks + i
            r.release()
        if not res:
            time.sleep(0.0005)
    secs = time.perf_counter() - t0
    if failed or wrong:
        raise RuntimeError(f"reads: {len(failed)} failed (e.g. {failed[:3]}), {wrong} wrong blocks")
    return secs


def delete_all(client: Any, bucket: str, keys: list[str]) -> None:
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})


# ---- plain boto3 ------------------------------------------------------------------------------


def boto_store(client: Any, bucket: str, items: list[tuple[str, bytes]], threads: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]), items))
    return time.perf_counter() - t0


def boto_load(client: Any, bucket: str, keys: list[str], threads: int, expect: int) -> float:
    def get(k: str) -> int:
        return len(client.get_object(Bucket=bucket, Key=k)["Body"].read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(get, keys))
    secs = time.perf_counter() - t0
    if got != expect:
        raise RuntimeError(f"boto3 loaded {got} of {expect} bytes")
    return secs


# ---- main -------------------------------------------------------------------------------------


def one_round(stores: dict[str, S3Store], client: Any, counts: dict[str, int], w: Workload, threads: int, tag: int,
              passes: int, order: tuple[str, ...]) -> dict[str, Any]:
    """Every side (our stores by name: "ours", and "auth" with MACs on; "boto3") stores the
    same payload (in ``order``), then loads it ``passes`` times, alternating the order pass
    by pass (so drift in the machine's load hits all), then deletes."""
    bucket = stores["ours"].config.bucket
    ids = [f"r{tag:02d}c{c:05d}" for c in range(w.nchunks)]
    items = [(f"bench/boto/r{tag:02d}/{c:05d}", w.chunk_bytes(c)) for c in range(w.nchunks)]
    keys = [k for k, _ in items]
    rec: dict[str, Any] = {"order": list(order), **{who: {"load_pass_s": []} for who in order}}
    headers: dict[str, dict[str, ChunkHeader]] = {}

    def requests_of(who: str) -> dict[str, int]:
        return stores[who].stats().requests if who in stores else dict(counts)

    for who in order:
        before = requests_of(who)
        if who in stores:
            rec[who]["store_s"], headers[who] = ours_store(stores[who], w, ids)
        else:
            rec[who]["store_s"] = boto_store(client, bucket, items, threads)
        rec[who]["store_requests"] = diff(requests_of(who), before)
    before = {who: requests_of(who) for who in order}
    for p in range(passes):
        for who in order if p % 2 == 0 else order[::-1]:
            secs = ours_load(stores[who], w, ids, headers[who]) if who in stores else \
                boto_load(client, bucket, keys, threads, w.payload_bytes)
            rec[who]["load_pass_s"].append(secs)
    for who in order:
        rec[who]["load_s"] = statistics.mean(rec[who]["load_pass_s"])
        rec[who]["load_requests"] = per_pass(diff(requests_of(who), before[who]), passes)
    delete_all(client, bucket, [st.key(i) for st in stores.values() for i in ids] + keys)
    return rec


def per_pass(requests: dict[str, int], passes: int) -> dict[str, int]:
    return {k: v // passes for k, v in requests.items()}


def per_block_round(client: Any, counts: dict[str, int], bucket: str, w: Workload, threads: int) -> dict[str, Any]:
    """Plain boto3, one object per block: the request-count reference."""
    items = [(f"bench/perblock/{b:06d}", w.block(b)) for b in range(w.nblocks)]
    before = dict(counts)
    ws = boto_store(client, bucket, items, threads)
    mid = dict(counts)
    rs = boto_load(client, bucket, [k for k, _ in items], threads, w.payload_bytes)
    after = dict(counts)
    delete_all(client, bucket, [k for k, _ in items])
    return {"store_s": ws, "load_s": rs, "store_requests": diff(mid, before), "load_requests": diff(after, mid)}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    with ExitStack() as stack:
        if a.endpoint_url is None:
            stack.enter_context(aws_test_env())
            server = MotoServer(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-s3-bench-"))))
            server.start()
            stack.callback(server.stop)
            server.create_bucket(a.bucket)
            endpoint, path_style, where = server.url, True, f"moto server {server.url} (pid {server.proc.pid})"
        else:
            endpoint, path_style, where = a.endpoint_url, a.path_style, a.endpoint_url
        w = Workload(a.total_mib * MiB, a.block_bytes, a.chunk_blocks)
        cfg = S3Config(bucket=a.bucket, prefix=a.prefix, endpoint_url=endpoint, path_style=path_style,
                       io_threads=a.threads, max_queued_writes=w.nchunks, deadline_s=60.0, read_timeout_s=30.0,
                       multipart_threshold_bytes=max(64 * MiB, 2 * w.chunk_blocks * w.block_bytes))
        store = S3Store(cfg, StoreContext(NAMESPACE, 0, a.block_bytes))
        stack.callback(store.close)
        stores = {"ours": store}
        if a.auth:  # its own prefix: the same payload, MACs on
            import dataclasses

            stores["auth"] = S3Store(dataclasses.replace(cfg, prefix=a.prefix + "auth/"),
                                     StoreContext(NAMESPACE, 0, a.block_bytes,
                                                  auth=ChunkAuth(os.urandom(32))))
            stack.callback(stores["auth"].close)
        # The baseline client: the same botocore settings as the store's (a fair comparison).
        import boto3
        from botocore.config import Config

        base = boto3.client("s3", endpoint_url=endpoint, config=Config(
            connect_timeout=cfg.connect_timeout_s, read_timeout=cfg.read_timeout_s, retries={"total_max_attempts": 1},
            max_pool_connections=2 * a.threads + 2, s3={"addressing_style": "path" if path_style else "auto"},
            request_checksum_calculation="when_required", response_checksum_validation="when_required"))
        counts = counting(base)
        print(f"{where}: {w.nchunks} chunks x {w.chunk_blocks} blocks x {w.block_bytes} B = "
              f"{w.payload_bytes / MiB:.0f} MiB per phase, {a.threads} threads, {a.repeats} rounds", flush=True)

        rounds = []
        for i in range(a.repeats):
            order: tuple[str, ...] = ("ours", "boto3") if i % 2 == 0 else ("boto3", "ours")
            if a.auth:
                order = ("ours", "auth", "boto3") if i % 2 == 0 else ("boto3", "auth", "ours")
            rec = one_round(stores, base, counts, w, a.threads, i, a.load_passes, order)
            rounds.append(rec)
            o, b = rec["ours"], rec["boto3"]
            print(f"  round {i + 1} ({'/'.join(order)}): store ours {w.payload_bytes / o['store_s'] / MB:.0f} "
                  f"boto3 {w.payload_bytes / b['store_s'] / MB:.0f} MB/s; load ours "
                  f"{w.payload_bytes / o['load_s'] / MB:.0f} boto3 {w.payload_bytes / b['load_s'] / MB:.0f} MB/s",
                  flush=True)
        per_block = per_block_round(base, counts, a.bucket, w, a.threads)

    gib = w.payload_bytes / GiB

    def med(who: str, k: str) -> float:
        return statistics.median(r[who][k] for r in rounds)

    cases = []
    for case in ("store", "load"):
        ours, boto = w.payload_bytes / med("ours", f"{case}_s") / MB, w.payload_bytes / med("boto3", f"{case}_s") / MB
        cases.append({"case": case, "bytes": w.payload_bytes, "ours_MBps": ours, "boto3_MBps": boto,
                      "ratio": ours / boto,
                      "paired_ratio": statistics.median(r["boto3"][f"{case}_s"] / r["ours"][f"{case}_s"]
                                                        for r in rounds),
                      "per_block_objects_MBps": w.payload_bytes / per_block[f"{case}_s"] / MB})
    reqs = []
    for case in ("store", "load"):
        ours_n = total(rounds[0]["ours"][f"{case}_requests"])
        chunk_n = total(rounds[0]["boto3"][f"{case}_requests"])
        block_n = total(per_block[f"{case}_requests"])
        reqs.append({"case": case, "ours_per_GiB": ours_n / gib, "boto3_chunk_objects_per_GiB": chunk_n / gib,
                     "one_object_per_block_per_GiB": block_n / gib, "ratio_vs_per_block": ours_n / block_n,
                     "ours_requests": rounds[0]["ours"][f"{case}_requests"],
                     "per_block_requests": per_block[f"{case}_requests"]})

    print()
    print(f"{'throughput':<11} {'bytes':>10} {'ours MB/s':>10} {'boto3 MB/s':>11} {'ratio':>6} {'paired':>7} "
          f"{'1 obj/block MB/s':>17}")
    for c in cases:
        print(f"{c['case']:<11} {c['bytes']:>10} {c['ours_MBps']:>10.0f} {c['boto3_MBps']:>11.0f} {c['ratio']:>6.2f} "
              f"{c['paired_ratio']:>7.2f} {c['per_block_objects_MBps']:>17.0f}")
    print(f"\n{'requests/GiB':<13} {'ours':>8} {'boto3, same objects':>20} {'1 object/block':>15} {'ours/per-block':>15}")
    for r in reqs:
        print(f"{r['case']:<13} {r['ours_per_GiB']:>8.0f} {r['boto3_chunk_objects_per_GiB']:>20.0f} "
              f"{r['one_object_per_block_per_GiB']:>15.0f} {r['ratio_vs_per_block']:>15.3f}")
    auth_rows = None
    if a.auth:
        auth_rows = []
        for case in ("store", "load"):
            on, off = w.payload_bytes / med("auth", f"{case}_s") / MB, w.payload_bytes / med("ours", f"{case}_s") / MB
            auth_rows.append({"case": case, "auth_MBps": on, "plain_MBps": off, "ratio": on / off,
                              "paired_ratio": statistics.median(r["ours"][f"{case}_s"] / r["auth"][f"{case}_s"]
                                                                for r in rounds)})
        print(f"\n{'MAC on/off':<11} {'on MB/s':>10} {'off MB/s':>10} {'ratio':>6} {'paired':>7}")
        for c in auth_rows:
            print(f"{c['case']:<11} {c['auth_MBps']:>10.0f} {c['plain_MBps']:>10.0f} {c['ratio']:>6.2f} "
                  f"{c['paired_ratio']:>7.2f}")
        print("(auth: HMAC-SHA256 of every block and header on store, verified on load; ratio = on/off)\n")
    print("(ratio = ours/boto3 of the median MB/s; paired = median over rounds of ours/boto3 within a round;")
    print(f" ours' stores exclude the manifest PUT, one per {cfg.manifest_every_writes} chunk writes: "
          f"+{100 / cfg.manifest_every_writes:.1f}% PUTs)")
    targets = {f"{c['case']}_throughput_ratio_ge_0.9": c["ratio"] >= 0.9 for c in cases}
    targets.update({f"{r['case']}_requests_le_0.1_of_per_block": r["ratio_vs_per_block"] <= 0.1 for r in reqs})
    for name, ok in targets.items():
        print(f"target {name}: {'PASS' if ok else 'FAIL'}")

    result = {
        "benchmark": "s3_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(a),
        "endpoint": where, "payload_bytes_per_phase": w.payload_bytes, "chunks": w.nchunks,
        "throughput": cases, "requests": reqs, "auth": auth_rows, "targets": targets, "rounds": rounds, "per_block_round": per_block,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }
    save_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
