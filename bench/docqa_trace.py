"""Write a synthetic document-QA trace (JSON Lines) for ``kvtier plan --trace``.

A few long documents are shared prefixes; each request asks a one-off question about
one of them (Zipf popularity that drifts). Deterministic: the same arguments give the
same file. See :mod:`vllm_kvtier.ops.trace_gen`.

    python bench/docqa_trace.py docqa.jsonl [--requests 6000] [--documents 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_kvtier.ops.trace_gen import DocQASpec, docqa_records  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the trace file to write")
    ap.add_argument("--requests", type=int, default=DocQASpec.requests)
    ap.add_argument("--documents", type=int, default=DocQASpec.documents)
    ap.add_argument("--seed", type=int, default=DocQASpec.seed)
    args = ap.parse_args(argv)
    try:
        records = docqa_records(DocQASpec(requests=args.requests, documents=args.documents, seed=args.seed))
    except ValueError as e:
        print(f"docqa_trace: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"{len(records):,} requests written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
