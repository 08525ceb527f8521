"""NIXL as the I/O engine of the NVMe and S3 tiers, against their default engines and the raw
references, on the same bytes in one run.

NVMe (``nvme.io_engine``): one directory, ``--total-mib`` of payload per phase as chunk files
of ``--chunk-blocks`` blocks, for each block size of ``--block-kib``, written then read back
(whole chunks, every CRC32 verified) through three sides, taking turns round after round
(``--repeats``; the order rotates every round so drift in the machine's load does not favour
one side):

* ``posix``: ``NVMeStore(io_engine="posix")``: ``pwrite``/``preadv`` in the I/O threads;
* ``nixl``: ``NVMeStore(io_engine="nixl")``: NIXL's POSIX backend (Linux AIO), the same
  store code otherwise (names, O_DIRECT, fdatasync, headers, checksums);
* ``dd``: ``dd oflag=direct conv=fdatasync`` / ``iflag=direct`` of the same payload in
  chunk-sized blocks (dd's own "copied, X s"), as in bench/nvme_throughput.py.

S3 (``s3.io_engine``): a moto server on 127.0.0.1 (or ``--endpoint-url``), ``--s3-total-mib``
per phase as objects of ``--s3-chunk-blocks`` blocks of ``--s3-block-bytes``, stored then
loaded ``--load-passes`` times through three sides taking turns the same way:

* ``boto3``: ``S3Store(io_engine="boto3")``;
* ``nixl``: ``S3Store(io_engine="nixl")``: NIXL's OBJ backend (aws-sdk-cpp) for the chunk
  PUTs and GETs, the same store code otherwise;
* ``raw``: plain boto3 ``put_object`` / ``get_object().read()`` of the same payload, one
  object per chunk, from a thread pool as large as the stores' I/O threads (no CRC, no
  header), as in bench/s3_throughput.py.

MB/s = payload bytes (blocks only) / wall seconds from the first submit until the last
completion, MB = 1e6 bytes; after ``--warmup`` untimed rounds, tables show medians over
rounds, the ratio of medians, the paired ratio (median over rounds of the ratio within a
round) and in how many rounds NIXL was the faster (about half: no evidence either way). The process CPU time of the
store sides (all threads, median) is kept too. ``UCX_MODULES=^ib`` is set unless the caller
set it (see vllm_kvtier/tiers/nixl/agent.py).

    python bench/nixl_io.py                                  # both tiers, defaults
    python bench/nixl_io.py --only nvme --dir /mnt/nvme/tmp --total-mib 4096
    python bench/nixl_io.py --only s3 --repeats 9

The machine is shared and noisy: compare ratios from the same run, not MB/s across runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_MODULES", "^ib")  # before any NIXL agent (see the doc)
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import nvme_throughput as nv  # noqa: E402
from bench import s3_throughput as s3b  # noqa: E402
from bench._common import save_json  # noqa: E402
from testkit.stores import nvme_section  # noqa: E402
from vllm_kvtier.tiers.nvme.store import NVMeStore  # noqa: E402
from vllm_kvtier.tiers.registry import StoreContext  # noqa: E402
from vllm_kvtier.tiers.s3.store import S3Config, S3Store  # noqa: E402

MB = 1e6
MiB = 1 << 20
KiB = 1 << 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["nvme", "s3"], default=None, help="run one tier only")
    p.add_argument("--repeats", type=int, default=9, help="timed rounds (each side once per round)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds first (first files and objects, NIXL agents, buffer pools)")
    g = p.add_argument_group("NVMe")
    g.add_argument("--dir", default=None, help="parent directory (default: a new temp dir under /var/tmp)")
    g.add_argument("--total-mib", type=int, default=512, help="payload per phase, MiB")
    g.add_argument("--block-kib", default="2048,128", help="comma-separated block sizes, KiB")
    g.add_argument("--chunk-blocks", type=int, default=16)
    g.add_argument("--io-threads", type=int, default=4)
    g.add_argument("--direct-io", choices=["auto", "on", "off"], default="auto")
    g = p.add_argument_group("S3")
    g.add_argument("--endpoint-url", default=None, help="use this endpoint instead of starting moto")
    g.add_argument("--bucket", default="kvtier-bench")
    g.add_argument("--path-style", action="store_true", help="(always on for the moto server)")
    g.add_argument("--s3-total-mib", type=int, default=64, help="payload per phase, MiB (moto keeps it in RAM)")
    g.add_argument("--s3-block-bytes", type=int, default=512 * KiB)
    g.add_argument("--s3-chunk-blocks", type=int, default=16)
    g.add_argument("--threads", type=int, default=4, help="S3Store io_threads = raw boto3 threads")
    g.add_argument("--load-passes", type=int, default=3)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "nixl_io.json"))
    a = p.parse_args(argv)
    a.blocks = [int(x) * KiB for x in a.block_kib.split(",") if x.strip()]
    if not a.blocks or min(a.blocks) <= 0 or min(a.repeats, a.total_mib, a.chunk_blocks, a.s3_total_mib,
                                                   a.s3_block_bytes, a.s3_chunk_blocks, a.threads,
                                                   a.load_passes) <= 0:
        p.error("sizes, counts and --repeats must be positive")
    return a


def order_of(sides: tuple[str, ...], i: int) -> tuple[str, ...]:
    """Round ``i``'s order: rotated, and reversed every other rotation (each side is first,
    middle and last as often as the others)."""
    k = i % len(sides)
    rot = sides[k:] + sides[:k]
    return rot if (i // len(sides)) % 2 == 0 else rot[::-1]


def summarize(rounds: list[dict[str, Any]], payload: int, phase: str, pairs: list[tuple[str, str]],
              sides: tuple[str, ...]) -> dict[str, Any]:
    """Medians, ratios of medians and paired ratios of one phase ('write', 'read', ...)."""
    key = f"{phase}_s"
    med = {s: statistics.median(r[s][key] for r in rounds) for s in sides}
    row: dict[str, Any] = {"phase": phase, "bytes": payload}
    for s in sides:
        row[f"{s}_MBps"] = payload / med[s] / MB
        row[f"{s}_median_s"] = med[s]
        cpu = [r[s].get(f"{phase}_cpu_s") for r in rounds]
        if all(c is not None for c in cpu):
            row[f"{s}_cpu_s"] = statistics.median(cpu)  # type: ignore[type-var]
    for num, den in pairs:
        row[f"{num}/{den}"] = med[den] / med[num]  # MB/s ratio = inverse time ratio
        row[f"{num}/{den}_paired"] = statistics.median(r[den][key] / r[num][key] for r in rounds)
        # Rounds in which num was faster: on a noisy shared machine, the sign test's view
        # (about half of them: no evidence either way).
        row[f"{num}/{den}_wins"] = sum(r[num][key] < r[den][key] for r in rounds)
    row["rounds"] = len(rounds)
    return row


# ---- NVMe ------------------------------------------------------------------------------------

NVME_SIDES = ("posix", "nixl", "dd")
NVME_PAIRS = [("nixl", "posix"), ("posix", "dd"), ("nixl", "dd")]


def nvme_side(store: NVMeStore, w: nv.Workload) -> dict[str, Any]:
    secs, headers, st = nv.time_ours_write(store, w, prefill=True)
    r: dict[str, Any] = {"write_s": secs, "write_cpu_s": st["cpu_s"], "write_refused": st["refused"]}
    r["drop_caches"] = nv.drop_caches()
    secs, st = nv.time_ours_read(store, w, headers)
    r["read_s"], r["read_cpu_s"] = secs, st["cpu_s"]
    nv.delete_ours(store, w)
    return r


def run_nvme(a: argparse.Namespace) -> dict[str, Any]:
    parent = Path(a.dir) if a.dir else Path("/var/tmp")
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="kvtier-nixl-io-", dir=parent))
    fs = nv.fs_type(base)
    cases = []
    try:
        for block_bytes in a.blocks:
            stores = {e: NVMeStore(nvme_section(base / e, direct_io=a.direct_io, io_threads=a.io_threads,
                                                max_queued_writes=64, io_engine=e),
                                   StoreContext(nv.NAMESPACE, 0, block_bytes))
                      for e in ("posix", "nixl")}
            w = nv.Workload(a.total_mib * MiB, block_bytes, a.chunk_blocks, tag=0xB10C)
            direct = stores["posix"].direct
            print(f"NVMe: {base} ({fs.get('type')} on {fs.get('device')}), O_DIRECT {direct}: {w.nchunks} chunks x "
                  f"{w.chunk_blocks} x {block_bytes // KiB} KiB = {w.payload_bytes / MiB:.0f} MiB per phase, "
                  f"io_threads {a.io_threads}", flush=True)
            rounds = []
            try:
                for i in range(-a.warmup, a.repeats):
                    order = order_of(NVME_SIDES, i)
                    rec: dict[str, Any] = {"order": list(order)}
                    for side in order:
                        if side == "dd":
                            d = nv.one_round_dd(base / "dd.bin", w)
                            rec[side] = {"write_s": d["write_s"], "read_s": d["read_s"],
                                         "write_wall_s": d["write_wall_s"], "read_wall_s": d["read_wall_s"]}
                        else:
                            rec[side] = nvme_side(stores[side], w)
                    if i >= 0:
                        rounds.append(rec)
                    print(f"  {'round' if i >= 0 else 'warm-up'} {i + 1} ({'/'.join(order)}): write " + " ".join(
                        f"{s} {w.payload_bytes / rec[s]['write_s'] / MB:.0f}" for s in NVME_SIDES) + " MB/s; read " +
                        " ".join(f"{s} {w.payload_bytes / rec[s]['read_s'] / MB:.0f}" for s in NVME_SIDES) + " MB/s",
                        flush=True)
            finally:
                for st in stores.values():
                    st.close()
            for phase in ("write", "read"):
                row = summarize(rounds, w.payload_bytes, phase, NVME_PAIRS, NVME_SIDES)
                cases.append({"case": f"{phase}/{block_bytes // KiB}KiB", "block_bytes": block_bytes,
                              "chunk_bytes": block_bytes * a.chunk_blocks, "o_direct": direct, **row})
            cases[-2]["round_records"] = rounds  # kept once per block size, with the write row
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"filesystem": fs, "cases": cases}


# ---- S3 --------------------------------------------------------------------------------------

S3_SIDES = ("boto3", "nixl", "raw")
S3_PAIRS = [("nixl", "boto3"), ("boto3", "raw"), ("nixl", "raw")]


def s3_round(stores: dict[str, S3Store], client: Any, w: s3b.Workload, a: argparse.Namespace, tag: int,
             order: tuple[str, ...]) -> dict[str, Any]:
    bucket = stores["boto3"].config.bucket
    ids = {s: [f"{s}-r{tag:02d}c{c:05d}" for c in range(w.nchunks)] for s in ("boto3", "nixl")}
    items = [(f"bench/raw/r{tag:02d}/{c:05d}", w.chunk_bytes(c)) for c in range(w.nchunks)]
    rec: dict[str, Any] = {"order": list(order)}
    headers: dict[str, Any] = {}
    for side in order:
        c0 = time.process_time()
        if side == "raw":
            secs = s3b.boto_store(client, bucket, items, a.threads)
        else:
            before = stores[side].stats().requests
            secs, headers[side] = s3b.ours_store(stores[side], w, ids[side])
        rec[side] = {"store_s": secs, "store_cpu_s": time.process_time() - c0, "load_pass_s": [],
                     "load_pass_cpu_s": []}
        if side != "raw":
            rec[side]["store_requests"] = s3b.diff(stores[side].stats().requests, before)
    for p in range(a.load_passes):
        for side in order if p % 2 == 0 else order[::-1]:
            c0 = time.process_time()
            if side == "raw":
                secs = s3b.boto_load(client, bucket, [k for k, _ in items], a.threads, w.payload_bytes)
            else:
                secs = s3b.ours_load(stores[side], w, ids[side], headers[side])
            rec[side]["load_pass_s"].append(secs)
            rec[side]["load_pass_cpu_s"].append(time.process_time() - c0)
    for side in order:
        rec[side]["load_s"] = statistics.mean(rec[side]["load_pass_s"])
        rec[side]["load_cpu_s"] = statistics.mean(rec[side]["load_pass_cpu_s"])
    s3b.delete_all(client, bucket, [stores[s].key(i) for s in ("boto3", "nixl") for i in ids[s]] +
                   [k for k, _ in items])
    return rec


def run_s3(a: argparse.Namespace) -> dict[str, Any]:
    with ExitStack() as stack:
        if a.endpoint_url is None:
            stack.enter_context(s3b.aws_test_env())
            server = s3b.MotoServer(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-nixl-io-"))))
            server.start()
            stack.callback(server.stop)
            server.create_bucket(a.bucket)
            endpoint, path_style, where = server.url, True, f"moto server {server.url}"
        else:
            endpoint, path_style, where = a.endpoint_url, a.path_style, a.endpoint_url
        w = s3b.Workload(a.s3_total_mib * MiB, a.s3_block_bytes, a.s3_chunk_blocks)
        stores = {}
        for engine in ("boto3", "nixl"):
            cfg = S3Config(bucket=a.bucket, prefix=f"bench-{engine}/", endpoint_url=endpoint, path_style=path_style,
                           io_threads=a.threads, max_queued_writes=w.nchunks, deadline_s=60.0, read_timeout_s=30.0,
                           multipart_threshold_bytes=max(64 * MiB, 2 * w.chunk_blocks * w.block_bytes),
                           io_engine=engine)  # type: ignore[arg-type]
            stores[engine] = S3Store(cfg, StoreContext(nv.NAMESPACE, 0, a.s3_block_bytes))
            stack.callback(stores[engine].close)
        import boto3
        from botocore.config import Config

        cfg = stores["boto3"].config
        client = boto3.client("s3", endpoint_url=endpoint, config=Config(
            connect_timeout=cfg.connect_timeout_s, read_timeout=cfg.read_timeout_s, retries={"total_max_attempts": 1},
            max_pool_connections=2 * a.threads + 2, s3={"addressing_style": "path" if path_style else "auto"},
            request_checksum_calculation="when_required", response_checksum_validation="when_required"))
        print(f"S3: {where}: {w.nchunks} objects x {w.chunk_blocks} x {w.block_bytes // KiB} KiB = "
              f"{w.payload_bytes / MiB:.0f} MiB per phase, {a.threads} threads, {a.load_passes} load passes",
              flush=True)
        rounds = []
        for i in range(-a.warmup, a.repeats):
            order = order_of(S3_SIDES, i)
            rec = s3_round(stores, client, w, a, i + a.warmup, order)
            if i >= 0:
                rounds.append(rec)
            print(f"  {'round' if i >= 0 else 'warm-up'} {i + 1} ({'/'.join(order)}): store " + " ".join(
                f"{s} {w.payload_bytes / rec[s]['store_s'] / MB:.0f}" for s in S3_SIDES) + " MB/s; load " +
                " ".join(f"{s} {w.payload_bytes / rec[s]['load_s'] / MB:.0f}" for s in S3_SIDES) + " MB/s",
                flush=True)
    cases = []
    for phase in ("store", "load"):
        row = summarize(rounds, w.payload_bytes, phase, S3_PAIRS, S3_SIDES)
        cases.append({"case": phase, "object_bytes": w.chunk_blocks * w.block_bytes, **row})
    requests = {s: rounds[0][s].get("store_requests") for s in ("boto3", "nixl")}
    return {"endpoint": where, "cases": cases, "store_requests_round1": requests, "rounds": rounds}


# ---- main ------------------------------------------------------------------------------------


def print_table(title: str, cases: list[dict[str, Any]], sides: tuple[str, ...],
                pairs: list[tuple[str, str]]) -> None:
    print(f"\n{title}")
    head = f"{'case':<14}" + "".join(f"{s + ' MB/s':>11}" for s in sides) + "".join(
        f"{n + '/' + d:>12}" for n, d in pairs) + f"{'paired':>8}{'wins':>7}" + "".join(
        f"{s + ' CPU s':>12}" for s in sides if f"{s}_cpu_s" in cases[0])
    print(head)
    for c in cases:
        line = f"{c['case']:<14}" + "".join(f"{c[s + '_MBps']:>11.0f}" for s in sides) + "".join(
            f"{c[n + '/' + d]:>12.2f}" for n, d in pairs) + f"{c[pairs[0][0] + '/' + pairs[0][1] + '_paired']:>8.2f}"
        line += f"{c[pairs[0][0] + '/' + pairs[0][1] + '_wins']:>4}/{c['rounds']:<2}"
        line += "".join(f"{c[s + '_cpu_s']:>12.2f}" for s in sides if f"{s}_cpu_s" in c)
        print(line)
    print(f"(ratios of median MB/s; paired = median over rounds of {pairs[0][0]}/{pairs[0][1]} within a round; "
          f"wins = rounds in which {pairs[0][0]} was faster than {pairs[0][1]}; CPU s = process CPU time, all "
          f"threads, median)")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    load_before = nv._loadavg()
    result: dict[str, Any] = {"benchmark": "nixl_io", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "args": {k: v for k, v in vars(a).items() if k != "blocks"}}
    if a.only in (None, "nvme"):
        result["nvme"] = run_nvme(a)
    if a.only in (None, "s3"):
        result["s3"] = run_s3(a)
    if "nvme" in result:
        print_table("NVMe tier: posix engine, nixl engine (NIXL POSIX backend), dd", result["nvme"]["cases"],
                    NVME_SIDES, NVME_PAIRS)
    if "s3" in result:
        print_table("S3 tier: boto3 engine, nixl engine (NIXL OBJ backend), raw boto3", result["s3"]["cases"],
                    S3_SIDES, S3_PAIRS)
    faster = {}
    for tier, (eng, default) in (("nvme", ("nixl", "posix")), ("s3", ("nixl", "boto3"))):
        if tier in result:
            ratios = {c["case"]: c[f"{eng}/{default}"] for c in result[tier]["cases"]}
            faster[tier] = {"nixl_over_default": ratios,
                            "nixl_faster_everywhere": all(r > 1.0 for r in ratios.values())}
            print(f"{tier}: nixl/{default} per case {', '.join(f'{k} {v:.2f}' for k, v in ratios.items())}")
    result["nixl_vs_default"] = faster
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                         "loadavg_before": load_before, "loadavg_after": nv._loadavg()}
    print(f"loadavg before: {load_before} | after: {result['machine']['loadavg_after']}")
    save_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
