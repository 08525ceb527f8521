"""Turn a dated run written up in Markdown into one ``bench/runs/*.json`` file.

The run's own facts (date, commit, command, machine) come as arguments; the text comes from
line ranges of a Markdown page. Each table becomes a list of row objects (column name to cell
text, bold markup dropped), titled by the paragraph just above it if one came after the
previous table. Every other paragraph or bullet becomes one string of ``notes``, in page
order. Nothing is computed or rounded.

    python bench/runs/from_markdown.py PAGE.md --lines 38-102,125-144 --name serving-vs-lmcache \\
        --benchmark bench/serving.py --date 2026-12-06 --time 13:31-14:41 --commit 1675729 \\
        --command "bench/serving.py ..." --machine "..." --source "docs/benchmarks.md at cf38e37"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cells(line: str) -> list[str]:
    return [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]


def _columns(names: list[str]) -> list[str]:
    """Header cells as row keys: a name written more than once takes the column before it
    as a prefix ("ideal p99 TTFT: ≤ 0.9?"), so no cell is lost to a repeated key."""
    return [f"{names[i - 1]}: {n}" if names.count(n) > 1 and i else n for i, n in enumerate(names)]


def parse(lines: list[str]) -> tuple[list[dict], list[str]]:
    """``(tables, notes)`` of a Markdown excerpt: see the module docstring."""
    tables: list[dict] = []
    notes: list[str] = []
    block: list[str] = []
    since_table = 0  # notes written since the last table
    i = 0

    def flush() -> None:
        if block:
            notes.append(" ".join(s.strip() for s in block))
            block.clear()

    while i < len(lines):
        line = lines[i]
        if line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: "):
            flush()
            title = notes.pop() if since_table < len(notes) else ""
            columns = _columns(_cells(line))
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(columns, _cells(lines[i]), strict=True)))
                i += 1
            tables.append({"title": title, "columns": columns, "rows": rows})
            since_table = len(notes)
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "![")):
            flush()
        elif stripped.startswith("- "):
            flush()
            block.append(stripped[2:])
        else:
            block.append(stripped)
        i += 1
    flush()
    return tables, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path)
    ap.add_argument("--lines", required=True, help="1-based inclusive ranges, e.g. 38-102,125-144")
    for name in ("name", "benchmark", "date", "commit", "command", "machine", "source"):
        ap.add_argument(f"--{name}", required=True)
    ap.add_argument("--time", default=None, help="UTC span of the run, e.g. 13:31-14:41")
    ap.add_argument("--note", action="append", default=[], help="a note of the converter's own, first")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/runs/DATE-NAME.json")
    args = ap.parse_args(argv)
    text = args.page.read_text().splitlines()
    picked: list[str] = []
    for span in args.lines.split(","):
        first, _, last = span.partition("-")
        picked += [*text[int(first) - 1:int(last or first)], ""]
    tables, notes = parse(picked)
    notes = [*args.note, *notes]
    run = {"name": args.name, "benchmark": args.benchmark, "date": args.date, "time_utc": args.time,
           "commit": None if args.commit == "-" else args.commit, "command": args.command,
           "machine": args.machine, "source": f"{args.source}, lines {args.lines}",
           "tables": tables, "notes": notes}
    out = args.out or Path(__file__).parent / f"{args.date}-{args.name}.json"
    out.write_text(json.dumps(run, indent=1, ensure_ascii=False) + "\n")
    print(out, f"{len(tables)} tables, {sum(len(t['rows']) for t in tables)} rows, {len(notes)} notes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
