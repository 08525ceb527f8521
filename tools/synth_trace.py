#!/usr/bin/env python3
"""Write the synthetic shared-documents trace (vllm_kvtier/ops/synth_trace.py) as JSONL.

    python tools/synth_trace.py docs_trace.jsonl [--seed 7] [--sessions 1500]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from vllm_kvtier.ops.synth_trace import DocsTraceShape, docs_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the JSONL file to write")
    ap.add_argument("--seed", type=int, default=DocsTraceShape.seed)
    ap.add_argument("--sessions", type=int, default=DocsTraceShape.sessions)
    a = ap.parse_args()
    records = docs_trace(dataclasses.replace(DocsTraceShape(), seed=a.seed, sessions=a.sessions))
    with open(a.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"{len(records):,} requests written to {a.out}")


if __name__ == "__main__":
    main()
