"""Small helpers the benchmark scripts share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_json(path: str | Path | None, result: dict[str, Any]) -> None:
    """Write a benchmark's results to ``path`` (skipped when empty) and say where."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {p}")
