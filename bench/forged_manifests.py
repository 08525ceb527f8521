"""Scheduler CPU that forged S3 manifests cost a scan, on a real S3 server (moto) on 127.0.0.1.

A writer stores 3 chunks and its manifest. Then ``--forged`` manifests of ``--mib`` MiB
are planted under other writer ids: zip bombs of 65,536 entries (about 270 MB inflated),
half unsigned and half with a wrong MAC (with ``--key``). With ``--key`` their names are
what a forger without the key can make (random, or the real writer's id with a wrong tag). A reader scans until no changed
manifest is left for later, then once more (nothing changed). The figure is
``time.process_time()`` of this process around each scan: every thread of the scheduler's
process (the scan's I/O pool included), not moto's.

    python bench/forged_manifests.py --forged 1000 --key --json bench/results/forged_manifests.json
    python bench/forged_manifests.py --forged 8 --key     # the tree before: each scan decodes them all
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench._common import save_json  # noqa: E402
from testkit.s3_server import MotoServer, aws_test_env  # noqa: E402
from tests.tiers.test_forged_manifests import AUTH, bomb, forged_names, plant  # noqa: E402
from tests.tiers.test_s3_store import BLOCK, NS, config, write  # noqa: E402
from vllm_kvtier.tiers.registry import StoreContext  # noqa: E402
from vllm_kvtier.tiers.s3.manifest import SIG_MAGIC  # noqa: E402
from vllm_kvtier.tiers.s3.store import S3Store  # noqa: E402


def run(forged: int, mib: int, key: bool, max_scans: int) -> dict[str, Any]:
    auth = AUTH if key else None
    with tempfile.TemporaryDirectory() as d, aws_test_env():
        server = MotoServer(Path(d))
        server.start()
        try:
            cfg = config(server, server.create_bucket(), deadline_s=30.0, read_timeout_s=30.0)
            writer = S3Store(replace(cfg, writer_id="writer"), StoreContext(NS, 0, BLOCK, auth=auth),
                             max_chunk_blocks=16)
            for i in range(3):
                write(writer, f"c{i}", 10 * i, 2, job=i + 1)
            writer.close()
            body = bomb(mib << 20)
            bodies = [body, body + SIG_MAGIC + AUTH.key_id + bytes(32)] if key else [body]
            plant(server, cfg.bucket, writer, bodies, forged, forged_names(writer, forged) if key else None)
            reader = S3Store(replace(cfg, writer_id="reader"), StoreContext(NS, 0, BLOCK, auth=auth),
                             max_chunk_blocks=16)
            scans: list[dict[str, Any]] = []
            try:
                while len(scans) < max_scans:  # until nothing is left for later, then once more
                    t0, c0 = time.perf_counter(), time.process_time()
                    found = reader.scan(collect=True).found
                    r = reader.last_scan
                    scans.append({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
                                  "found": len(found), "manifest_gets": r.manifest_gets,
                                  "refused": getattr(r, "manifests_refused", None),
                                  "deferred": getattr(r, "manifests_deferred", 0)})
                    if len(scans) > 1 and not scans[-2]["deferred"]:
                        break
            finally:
                reader.close()
        finally:
            server.stop()
    return {"forged": forged, "mib": mib, "key": key, "scans": scans,
            "first_scan_cpu_s": scans[0]["cpu_s"], "max_scan_cpu_s": max(s["cpu_s"] for s in scans),
            "total_cpu_s": sum(s["cpu_s"] for s in scans[:-1]), "last_scan_cpu_s": scans[-1]["cpu_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forged", type=int, default=1000)
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument("--key", action="store_true", help="the reader and writer hold a key")
    ap.add_argument("--max-scans", type=int, default=400)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    res = run(a.forged, a.mib, a.key, a.max_scans)
    print(f"{a.forged} forged manifests of {a.mib} MiB, key={a.key}: {len(res['scans'])} scans")
    print(f"{'scan':>5} {'cpu s':>8} {'wall s':>8} {'GETs':>5} {'refused':>8} {'deferred':>8} {'found':>6}")
    for i, s in enumerate(res["scans"]):
        print(f"{i:5d} {s['cpu_s']:8.3f} {s['wall_s']:8.3f} {s['manifest_gets']:5d} {s['refused']!s:>8} "
              f"{s['deferred']:8d} {s['found']:6d}")
    print(f"first scan {res['first_scan_cpu_s']:.3f} s CPU, largest {res['max_scan_cpu_s']:.3f} s, "
          f"until all read {res['total_cpu_s']:.3f} s, then unchanged {res['last_scan_cpu_s']:.3f} s")
    save_json(a.json, res)


if __name__ == "__main__":
    main()
