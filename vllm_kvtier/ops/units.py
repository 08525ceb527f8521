"""Sizes, counts and token lengths as an operator writes them, parsed; bytes as a report
prints them. Bad input raises :class:`PlanInputError` naming the option or field."""

from __future__ import annotations

import math
import re

from vllm_kvtier.config.units import size_bytes
from vllm_kvtier.errors import KVTierError


class PlanInputError(KVTierError, ValueError):
    """Bad planner input. ``field`` names the config.json field, the CLI option or the file."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def parse_size(text: str, option: str, *, allow_zero: bool = False) -> int:
    """Bytes from ``"42949672960"``, ``"80GB"`` (10^9) or ``"40GiB"`` (2^30)."""
    try:
        n = size_bytes(text)
    except ValueError as e:
        raise PlanInputError(option, str(e)) from None
    if n < 0 or (n == 0 and not allow_zero):
        raise PlanInputError(option, f"must be positive, got {text!r}")
    return n


def parse_tokens(text: str, option: str) -> int:
    """A token count: ``"131072"``, ``"128K"`` (= 131,072) or ``"1M"`` (= 1,048,576)."""
    m = re.fullmatch(r"\s*(\d+)\s*([km]?)\s*", text, re.IGNORECASE)
    if not m:
        raise PlanInputError(option, f"not a token count: {text!r}")
    n = int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()]
    if n <= 0:
        raise PlanInputError(option, f"must be positive, got {text!r}")
    return n


def parse_positive(text: str, option: str, *, upper: float = math.inf) -> float:
    """A number in (0, ``upper``]."""
    try:
        v = float(text)
    except ValueError:
        raise PlanInputError(option, f"not a number: {text!r}") from None
    if not 0 < v <= upper or math.isnan(v):
        raise PlanInputError(option, f"must be > 0{'' if upper == math.inf else f' and <= {upper:g}'}, got {text}")
    return v


def parse_count(text: str, option: str) -> int:
    """A positive integer (a count of blocks, requests, instances)."""
    try:
        n = int(text)
    except ValueError:
        raise PlanInputError(option, f"not an integer: {text!r}") from None
    if n <= 0:
        raise PlanInputError(option, f"must be a positive integer, got {n}")
    return n


def human_bytes(n: int) -> str:
    """``"42.95 GB = 40.00 GiB"``: both a decimal (10^3) and a binary (2^10) unit."""
    def scaled(base: int, units: tuple[str, ...]) -> str:
        i = 0
        while i + 1 < len(units) and abs(n) >= base ** (i + 1):
            i += 1
        return f"{n / base**i:.2f} {units[i]}" if i else f"{n} B"
    return f"{scaled(1000, ('B', 'kB', 'MB', 'GB', 'TB', 'PB'))} = {scaled(1024, ('B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'))}"


def exact_bytes(n: int) -> str:
    """``"42,949,672,960 B = 42.95 GB = 40.00 GiB"``."""
    return f"{n:,} B" if abs(n) < 1000 else f"{n:,} B = {human_bytes(n)}"
