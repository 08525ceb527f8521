"""Sizes written as people write them: ``"42949672960"``, ``"80GB"`` (10^9), ``"40GiB"`` (2^30).

One parser for the config (every ``*_bytes`` field) and for ``kvtier plan``'s options, so a
size means the same everywhere it is read. Pure: no I/O.
"""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]i?b|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def size_bytes(text: str) -> int:
    """Bytes from a size string. Raises :class:`ValueError` with the reason."""
    m = _SIZE_RE.match(text)
    if not m:
        hint = " (say GB or GiB: a bare G is ambiguous)" if re.search(r"\d\s*[kmgtp]i?$", text, re.I) else ""
        raise ValueError(f"not a size: {text!r}{hint}")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()])
