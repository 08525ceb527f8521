"""Scheduler-thread time of merging one S3 rescan into the chunk index, at 400k objects.

Issue 14: merging a rescan cost ~1 s of scheduler-thread time at 400k objects (the whole
listing intersected with the whole index, on that thread, in one step). Now the rescan
thread computes the delta and the scheduler applies it in slices. This script measures
what a step pays: it builds the real :class:`ChunkPlanner` with the real ``Rescanner``
over a prepared listing (no S3: the listing's own cost is on the rescan thread either way),
the index already holding ``--objects`` chunks from start-up; the rescan then lists them
again with ``--churn`` of them replaced (expired, and as many new). Each
``ChunkPlanner.take_jobs()`` (the planner's part of one engine step) is timed until the rescan is fully
merged; the figure is the longest step and the sum of the steps.

Self-contained and using only APIs that exist before and after the change, so the lead can
run the same file on both trees: ``PYTHONPATH=/work/main python bench/rescan_merge.py``
(before) and from this tree (after). The mode is detected (``Rescanner(initial=...)``
exists only after); ``--mode`` forces the label. The ratio compares the two JSONs given
with ``--before``.

    python bench/rescan_merge.py --json bench/results/rescan_merge.json
    python bench/rescan_merge.py --before bench/results/rescan_merge_before.json
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: the tree it names is the one measured

from bench._common import save_json  # noqa: E402
from vllm_kvtier.chunkformat import ChunkHeader, align_up, header_bytes_for  # noqa: E402
from vllm_kvtier.metrics import Counters  # noqa: E402
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy  # noqa: E402

try:  # the catalog of issue 34 (this tree); before it, the rescanner stood in plan/
    from vllm_kvtier.catalog.rescan import Rescanner
    CATALOG = True
except ImportError:
    from vllm_kvtier.plan.chunk_plan import Rescanner  # type: ignore[attr-defined,no-redef]
    CATALOG = False

NS = "bench00000000000"
BLOCK = 64 << 10


def listing(first: int, n: int, blocks: int) -> dict[str, ChunkHeader]:
    """``n`` chunk headers (ids ``first..first+n``) of ``blocks`` blocks, built directly (no
    CRC work: the merge never reads them)."""
    stride = align_up(BLOCK)
    hb = header_bytes_for(blocks)
    out = {}
    for i in range(first, first + n):
        keys = tuple((i * blocks + j).to_bytes(8, "big") * 4 for j in range(blocks))
        out[f"{i:012x}"] = ChunkHeader(NS, keys, (0,) * blocks, BLOCK, stride, hb)
    return out


def run(objects: int, churn: float, blocks: int) -> dict[str, Any]:
    start = listing(0, objects, blocks)
    gone = int(objects * churn)
    again = dict(list(start.items())[gone:])  # the oldest expired...
    again.update(listing(objects, gone, blocks))  # ...and as many new ones
    served = threading.Event()
    stop = threading.Event()

    def scan() -> list[dict[str, ChunkHeader]]:
        if served.is_set():
            stop.wait()  # one rescan only
            return [again]
        served.set()
        return [again]

    after = "initial" in inspect.signature(Rescanner.__init__).parameters
    kw: dict[str, Any] = {"initial": [start]} if after else {}
    rescanner = Rescanner("s3", scan, 0.01, **kw)
    policy = ChunkPolicy("s3", "write-through", 1, blocks, None)
    if "ctx" in inspect.signature(ChunkPlanner.__init__).parameters:  # a context and a listing
        from vllm_kvtier.catalog.base import Listing
        from vllm_kvtier.plan.chunk_plan import PlannerContext  # type: ignore[attr-defined]

        planner = ChunkPlanner(policy, PlannerContext(1, BLOCK, Counters()), Listing([start], catalog=rescanner))
    else:
        planner = ChunkPlanner(policy, world_size=1, block_bytes_per_rank=BLOCK, counters=Counters(),  # type: ignore[call-arg]
                               found=[start], **{"catalog" if CATALOG else "rescanner": rescanner})
    want_in = next(iter(listing(objects + gone - 1, 1, blocks).values())).keys[0]
    want_out = next(iter(start.values())).keys[0] if gone else None
    gc.collect()
    steps: list[float] = []
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            t = time.perf_counter()
            planner.take_jobs(set(), lambda k: None)  # one engine step: it merges what a rescan found
            dt = time.perf_counter() - t
            if served.is_set():
                steps.append(dt)
            merged = planner.locate(want_in) is not None  # type: ignore[arg-type]
            # Before: the merge never removed what the listing lost (the defect).
            removed = want_out is None or not after or planner.locate(want_out) is None  # type: ignore[arg-type]
            pending = getattr(planner, "rescan_pending", lambda: 0)()
            if merged and removed and not pending:
                break
            time.sleep(0.001)  # the rest of an engine step
        else:
            raise SystemExit("the rescan was never merged")
    finally:
        stop.set()
        rescanner.close()
    busy = [s for s in steps if s > 20e-6]
    return {"mode": "after" if after else "before", "objects": objects, "churn": churn, "blocks_per_chunk": blocks,
            "steps_with_work": len(busy), "max_step_s": max(steps), "sum_steps_s": sum(busy),
            "index_keys_after": len(planner.index)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=400_000)
    ap.add_argument("--churn", type=float, default=0.01, help="fraction of the listing replaced by the rescan")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per chunk (memory: ~1 KB + 110 B a block)")
    ap.add_argument("--mode", choices=("auto", "before", "after"), default="auto", help="label only")
    ap.add_argument("--before", default="", help="a JSON of this script from the old tree: print the ratio")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "rescan_merge.json"))
    args = ap.parse_args()
    res = run(args.objects, args.churn, args.blocks)
    if args.mode != "auto":
        res["mode"] = args.mode
    print(f"{'mode':<8}{'objects':>10}{'steps':>8}{'max step (ms)':>16}{'sum (ms)':>12}")
    print(f"{res['mode']:<8}{res['objects']:>10}{res['steps_with_work']:>8}{res['max_step_s'] * 1e3:>16.2f}"
          f"{res['sum_steps_s'] * 1e3:>12.2f}")
    out: dict[str, Any] = {"benchmark": "rescan_merge", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **res}
    if args.before:
        before = json.loads(Path(args.before).read_text())
        out["before"] = before
        out["max_step_ratio"] = res["max_step_s"] / before["max_step_s"]
        print(f"longest step, after over before: {out['max_step_ratio']:.4f} "
              f"({res['max_step_s'] * 1e3:.2f} ms vs {before['max_step_s'] * 1e3:.2f} ms)")
    save_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
