"""Checks of one numeric field, shared by every section: each raises
:class:`~vllm_kvtier.errors.ConfigError` naming the dotted field (``nvme.chunk_blocks``)."""

from __future__ import annotations

from vllm_kvtier.errors import ConfigError


def positive(path: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(path, f"must be > 0, got {value}")


def at_least(path: str, value: float, low: float) -> None:
    if not value >= low:
        raise ConfigError(path, f"must be >= {low}, got {value}")


def at_most(path: str, value: float, high: float) -> None:
    if not value <= high:
        raise ConfigError(path, f"must be <= {high}, got {value}")


def in_range(path: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(path, f"must be in [{low}, {high}], got {value}")
