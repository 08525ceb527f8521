"""How much DRAM this process may still use.

It is the host's available memory, capped by the container's cgroup limit (a Kubernetes
pod's ``resources.limits.memory``).

Who calls it: the connector when it sizes the CPU tier, once, at start-up. There a fixed
``cpu.capacity_bytes`` that cannot fit fails the start, naming the field. Also ``kvtier
check-config`` (a warning) and ``kvtier doctor``. Reads ``/proc`` and ``/sys`` only; never
raises.

Why the cgroup matters: ``MemAvailable`` is the *node's* free memory. In a pod limited to
64 GiB on a 1 TiB node, half of "available" would be far above the limit, and the pool's
first touches would get the pod OOM-killed.
"""

from __future__ import annotations

from pathlib import Path

_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a huge page-aligned number


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{"MemTotal": ..., "MemAvailable": ...}``); {} if unreadable."""
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory_limit(root: str = "/sys/fs/cgroup") -> int | None:
    """The container's memory limit (cgroup v2 ``memory.max`` or v1), None when unlimited."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        if (Path(root) / name).exists():
            limit = _read_int(Path(root) / name)  # v2 "max" reads as None
            return limit if limit is not None and limit < _NO_LIMIT else None
    return None


def cgroup_memory_usage(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the container uses now (cgroup v2 ``memory.current`` or v1), None if unknown."""
    for name in ("memory.current", "memory/memory.usage_in_bytes"):
        got = _read_int(Path(root) / name)
        if got is not None:
            return got
    return None


def available_memory(root: str = "/sys/fs/cgroup", meminfo: str = "/proc/meminfo") -> tuple[int, str]:
    """(bytes this process may still allocate, where the figure comes from)."""
    host = read_meminfo(meminfo).get("MemAvailable")
    if host is None:
        import psutil

        host = int(psutil.virtual_memory().available)
    limit = cgroup_memory_limit(root)
    if limit is not None:
        headroom = max(0, limit - (cgroup_memory_usage(root) or 0))
        if headroom < host:
            return headroom, "the cgroup memory limit minus its current usage"
    return host, "MemAvailable"


def budget_overrun(capacity_bytes: int | None) -> str | None:
    """Why a CPU tier of ``capacity_bytes`` (``cpu.capacity_bytes``) cannot fit.

    The limit is what this process may still allocate. The answer is a sentence with both
    figures. None when it fits, or when no fixed budget is set. Then
    ``cpu.capacity_fraction`` sizes from this figure."""
    if capacity_bytes is None:
        return None
    available, where = available_memory()
    if capacity_bytes <= available:
        return None
    return (f"{capacity_bytes / 2**30:.1f} GiB is more than this machine "
            f"can still allocate ({available / 2**30:.1f} GiB, {where}); lower it, or size the "
            f"tier with cpu.capacity_fraction")
