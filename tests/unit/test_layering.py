"""The package's layers (design.md, "Layers of the package"), checked on its imports.

Every ``import`` of every module of ``vllm_kvtier`` is read with ``ast`` (module level,
inside functions, under ``TYPE_CHECKING``: all of them) and checked against the rules:

* vLLM is imported only in ``connector/``;
* torch is never imported by the bottom (keys, errors, jobs), config, ``index/`` or ``plan/``;
* each layer imports only the layers below it (``ALLOWED``); ``cli``/``ops`` (the
  ``kvtier`` tools) are never imported by serving code and never import ``connector/``;
* ``plan/`` does no I/O: it imports no thread, process, socket, file or remote-client
  module (``NO_IO_IN_PLAN``) and never calls ``open``.

``KNOWN_VIOLATIONS`` lists the edges of today's tree that break a rule and the step of
issue 12 that removes each: the test fails on any edge not listed, and on a listed edge
that is gone (delete it from the list then).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

PKG = "vllm_kvtier"
ROOT = Path(__file__).resolve().parents[2] / PKG

#: layer -> the layers it may import (its own is always allowed)
ALLOWED: dict[str, set[str]] = {
    "keys": set(),
    "errors": set(),
    "jobs": {"keys"},  # a job names its tier by TierName
    # plugins: an object named "package.module:Name" (an out-of-tree tier's spec)
    "plugins": set(),
    "config": {"keys", "errors", "cpus", "plugins"},
    "index": {"keys", "errors"},
    "metrics": {"keys", "errors"},
    "sysmem": set(),
    "cpus": set(),  # where the plugin's own threads run: imports nothing of the package
    "chunkformat": {"keys", "errors"},
    # what the tiers below CPU hold, learned on the catalog's own threads: below plan (which
    # takes its deltas and answers) and below tiers (a medium's spec builds its catalog)
    "catalog": {"keys", "errors", "metrics", "chunkformat"},
    # a medium's spec builds its scheduler half too: the catalog of what the tier holds
    "tiers": {"keys", "errors", "config", "metrics", "chunkformat", "cpus", "catalog", "plugins"},
    "plan": {"keys", "errors", "jobs", "config", "index", "metrics", "chunkformat", "catalog"},
    # design.md lists "tiers, jobs, keys, config"; metrics (plain counters, importing nothing
    # internal) is allowed too: the tiers below transfer may import it, so transfer may
    "transfer": {"keys", "errors", "jobs", "config", "tiers", "chunkformat", "metrics", "cpus"},
    "exporter": {"keys", "errors", "metrics"},
    # what the connector builds that needs no vLLM: the tiers' planners and data paths
    "engine": {"keys", "errors", "jobs", "config", "index", "metrics", "sysmem", "cpus", "chunkformat", "catalog",
               "tiers", "plan", "transfer", "exporter", "plugins"},
    "connector": {"keys", "errors", "jobs", "config", "index", "metrics", "sysmem", "cpus", "chunkformat", "catalog",
                  "tiers", "plan", "transfer", "exporter", "plugins", "engine"},
    # and the root package, which holds only the version and imports nothing
    "tools": {"keys", "errors", "jobs", "config", "index", "metrics", "sysmem", "cpus", "chunkformat", "catalog",
              "tiers", "plan", "transfer", "exporter", "plugins", "engine", "root"},
    "root": set(),
}
#: layers that may not import torch
NO_TORCH = {"keys", "errors", "jobs", "config", "index", "catalog", "plan"}
#: What the planner never imports: threads, processes, sockets, files, remote clients. It
#: decides; the catalog lists and asks, the tiers move bytes (docs/architecture.md).
NO_IO_IN_PLAN = frozenset({
    "threading", "_thread", "concurrent", "multiprocessing", "subprocess", "asyncio", "selectors", "select",
    "socket", "ssl", "http", "urllib", "requests", "boto3", "botocore", "mooncake", "nixl",
    "os", "io", "pathlib", "shutil", "tempfile", "mmap", "fcntl", "glob",
})

#: (importer, imported) edges of today's tree that break a rule, with the step that removes
#: each. Keep it short: a new edge fails the test; an edge that disappears must go too.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {
}


def layer_of(module: str) -> str | None:
    """The layer of a ``vllm_kvtier`` module, None for a third-party one."""
    if module != PKG and not module.startswith(PKG + "."):
        return None
    parts = module.split(".")[1:]
    if not parts:
        return "root"
    head = parts[0]
    if head in ("keys", "errors", "jobs", "config", "index", "metrics", "sysmem", "cpus", "chunkformat", "catalog",
                "tiers", "plan", "transfer", "exporter", "connector", "plugins", "engine"):
        return head
    if head in ("cli", "ops", "doctor"):
        return "tools"
    raise AssertionError(f"{module}: no layer for it; add it to layer_of and ALLOWED")


def imports_of(module: str, source: str, *, is_package: bool) -> list[tuple[str, int]]:
    """Every module ``source`` imports (absolute names, relative ones resolved), with the
    line: module level, inside functions and classes, under ``if TYPE_CHECKING``."""
    found: list[tuple[str, int]] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import mod` imports pkg.mod: name it, so a module's own rule applies
            found += [(f"{target}.{a.name}" if target.startswith(PKG) else target, node.lineno)
                      for a in node.names]
    return found


def _known(name: str, modules: set[str]) -> str:
    """``name`` or its longest prefix that is a module of the package."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def violations(sources: dict[str, tuple[str, bool]]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> the rule it breaks, for ``sources`` = module -> (source,
    is_package)."""
    modules = set(sources)
    out: dict[tuple[str, str], str] = {}
    for module, (source, is_package) in sorted(sources.items()):
        mine = layer_of(module)
        assert mine is not None
        for name, line in imports_of(module, source, is_package=is_package):
            top = name.split(".")[0]
            if top == "vllm" and mine != "connector":
                out[(module, "vllm")] = f"line {line}: vLLM imported outside connector/"
            elif top == "torch" and mine in NO_TORCH:
                out[(module, "torch")] = f"line {line}: torch imported by the {mine} layer"
            elif top == PKG:
                target = _known(name, modules)
                theirs = layer_of(target)
                assert theirs is not None
                if theirs != mine and theirs not in ALLOWED[mine]:
                    out[(module, target)] = f"line {line}: the {mine} layer imports the {theirs} layer"
    return out


def plan_io(sources: dict[str, tuple[str, bool]]) -> dict[str, str]:
    """module -> what it does that a planner must not, for the modules of ``plan/``: an
    import of :data:`NO_IO_IN_PLAN` (lazy or under ``TYPE_CHECKING`` too), or a call of
    the builtin ``open``."""
    out: dict[str, str] = {}
    for module, (source, is_package) in sorted(sources.items()):
        if layer_of(module) != "plan":
            continue
        for name, line in imports_of(module, source, is_package=is_package):
            if name.split(".")[0] in NO_IO_IN_PLAN:
                out[module] = f"line {line}: imports {name}"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                out[module] = f"line {node.lineno}: calls open()"
    return out


def package_sources() -> dict[str, tuple[str, bool]]:
    sources = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        sources[".".join(parts)] = (path.read_text(), is_package)
    return sources


def test_the_package_keeps_its_layers():
    found = violations(package_sources())
    new = {edge: why for edge, why in found.items() if edge not in KNOWN_VIOLATIONS}
    gone = [edge for edge in KNOWN_VIOLATIONS if edge not in found]
    assert not new, "imports that break the layering rules:\n" + "\n".join(
        f"  {a} -> {b}: {why}" for (a, b), why in sorted(new.items()))
    assert not gone, f"fixed, remove from KNOWN_VIOLATIONS: {gone}"


def test_the_checker_catches_each_kind_of_violation():
    """A synthetic package breaking every rule once, lazily or relatively where it can."""
    synthetic = {
        "vllm_kvtier": ("", True),
        "vllm_kvtier.jobs": ("from vllm_kvtier.errors import KVTierError\n", False),
        "vllm_kvtier.errors": ("", False),
        "vllm_kvtier.index": ("", True),
        "vllm_kvtier.keys": ("", False),
        "vllm_kvtier.index.slots": ("def f():\n    from ..plan import scheduler\n", False),
        "vllm_kvtier.plan": ("", True),
        "vllm_kvtier.plan.scheduler": ("def f():\n    import torch\n", False),
        "vllm_kvtier.plan.saves": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from vllm.v1.request import Request\n", False),
        "vllm_kvtier.plan.ok": ("from vllm_kvtier import chunkformat\nfrom . import saves\n", False),
        "vllm_kvtier.chunkformat": ("from vllm_kvtier.tiers import disk\n", False),
        "vllm_kvtier.tiers": ("", True),
        "vllm_kvtier.tiers.disk": ("from vllm_kvtier.transfer.copier import Copy\n", False),
        "vllm_kvtier.transfer": ("", True),
        "vllm_kvtier.transfer.copier": ("import torch\n", False),
        "vllm_kvtier.connector": ("import vllm\nimport torch\nfrom vllm_kvtier.plan import scheduler\n", True),
        "vllm_kvtier.cli": ("def main():\n    from vllm_kvtier.connector import KVTierConnector\n", False),
    }
    assert set(violations(synthetic)) == {
        ("vllm_kvtier.jobs", "vllm_kvtier.errors"),  # the bottom imports nothing internal but keys
        ("vllm_kvtier.index.slots", "vllm_kvtier.plan.scheduler"),  # lower imports higher (relative, lazy)
        ("vllm_kvtier.plan.scheduler", "torch"),  # a planner imports torch (lazily)
        ("vllm_kvtier.plan.saves", "vllm"),  # vLLM outside connector/ (even for typing)
        ("vllm_kvtier.tiers.disk", "vllm_kvtier.transfer.copier"),  # tiers under transfer
        ("vllm_kvtier.chunkformat", "vllm_kvtier.tiers.disk"),  # the chunk format under the tiers
        ("vllm_kvtier.cli", "vllm_kvtier.connector"),  # the tools never import the connector
    }


def test_the_planner_does_no_io():
    """No module of ``plan/`` starts a thread or touches a file, a socket or a remote
    store: listings and pool lookups run in ``catalog/``, bytes move in ``tiers/``."""
    found = plan_io(package_sources())
    assert not found, "plan/ does I/O:\n" + "\n".join(f"  {m}: {why}" for m, why in sorted(found.items()))


def test_the_io_check_catches_each_kind():
    """A synthetic plan/ that does I/O each way once (lazily, relatively, for typing);
    the same imports outside plan/ are fine."""
    synthetic = {
        "vllm_kvtier": ("", True),
        "vllm_kvtier.plan": ("", True),
        "vllm_kvtier.plan.rescan": ("import threading\n", False),
        "vllm_kvtier.plan.pool": ("def f():\n    from concurrent.futures import ThreadPoolExecutor\n", False),
        "vllm_kvtier.plan.paths": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from pathlib import Path\n", False),
        "vllm_kvtier.plan.s3": ("import boto3.session\n", False),
        "vllm_kvtier.plan.reads": ("def f(p):\n    return open(p).read()\n", False),
        "vllm_kvtier.plan.ok": ("import time\nfrom . import rescan\nfrom vllm_kvtier.catalog import base\n", False),
        "vllm_kvtier.catalog": ("", True),
        "vllm_kvtier.catalog.base": ("import threading\nimport os\n", False),
    }
    assert set(plan_io(synthetic)) == {
        "vllm_kvtier.plan.rescan", "vllm_kvtier.plan.pool", "vllm_kvtier.plan.paths", "vllm_kvtier.plan.s3",
        "vllm_kvtier.plan.reads",
    }


def test_the_planners_run_without_vllm_or_torch():
    """Import the scheduler-side planner and plan a step in a fresh interpreter: neither
    vLLM nor torch may be loaded, even indirectly."""
    code = (
        "import sys\n"
        "from vllm_kvtier.config import parse_config\n"
        "from vllm_kvtier.plan.inputs import StepInput\n"
        "from vllm_kvtier.plan.scheduler import PlannerSetup, SchedulerPlanner\n"
        "p = SchedulerPlanner(parse_config({}), PlannerSetup(16, 8, 1))\n"
        "p.plan_step(StepInput({}))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent, timeout=120)


def test_the_connector_only_adapts_vllm():
    """Every module of ``connector/`` imports vLLM, or is imported only by modules of
    ``connector/`` that do: what needs no vLLM lives below it (``engine/`` and the rest)."""
    sources = package_sources()
    modules = set(sources)
    imports = {m: [_known(n, modules) if n.startswith(PKG) else n.split(".")[0]
                   for n, _ in imports_of(m, src, is_package=pkg)]
               for m, (src, pkg) in sources.items()}
    adapters = {m for m in sources if layer_of(m) == "connector" and "vllm" in imports[m]}
    idle = []
    for m in sorted(sources):
        if layer_of(m) != "connector" or m in adapters:
            continue
        users = {u for u, names in imports.items() if m in names and u != m}
        if not users or not users <= adapters:
            idle.append(f"{m} (imported by {sorted(users) or 'nothing'})")
    assert not idle, "connector/ modules that neither import vLLM nor serve one that does:\n  " + "\n  ".join(idle)


def floors(allowed: Mapping[str, set[str]]) -> list[set[str]]:
    """The layers bottom up, in floors: each layer imports only layers on floors below its
    own. Raises AssertionError naming the layers left when some import each other (an
    arrow back up)."""
    left, below, out = dict(allowed), set(), []
    while left:
        floor = {layer for layer, imports in left.items() if imports <= below}
        if not floor:
            raise AssertionError(f"an arrow back up among {sorted(left)}")
        out.append(floor)
        below |= floor
        for layer in floor:
            del left[layer]
    return out


def test_the_layers_stack_in_floors_with_no_arrow_back_up():
    stack = floors(ALLOWED)
    floor = {layer: i for i, f in enumerate(stack) for layer in f}
    assert floor["keys"] == floor["errors"] == 0
    assert floor["catalog"] < floor["tiers"] < floor["transfer"] < floor["engine"] < floor["connector"]
    assert floor["plan"] < floor["engine"]
    with pytest.raises(AssertionError, match="an arrow back up"):
        floors({**ALLOWED, "tiers": ALLOWED["tiers"] | {"transfer"}})


def climbs(calls: list[tuple[str, str]]) -> list[str]:
    """The calls of ``calls`` ((caller module, callee module)) that go back up a floor: into
    a layer the caller's layer may not import."""
    out = []
    for caller, callee in calls:
        mine, theirs = layer_of(caller), layer_of(callee)
        if mine is not None and theirs is not None and theirs != mine and theirs not in ALLOWED[mine]:
            out.append(f"{caller} -> {callee}")
    return out


def test_the_climb_check_catches_a_call_back_up():
    assert climbs([("vllm_kvtier.engine.lower", "vllm_kvtier.tiers.spec"),
                   ("vllm_kvtier.tiers.nvme.spec", "vllm_kvtier.config.sections")]) == []
    assert climbs([("vllm_kvtier.tiers.nvme.spec", "vllm_kvtier.transfer.fp8"),
                   ("vllm_kvtier.transfer.tier_io", "vllm_kvtier.engine.lower")]) == [
        "vllm_kvtier.tiers.nvme.spec -> vllm_kvtier.transfer.fp8",
        "vllm_kvtier.transfer.tier_io -> vllm_kvtier.engine.lower"]


def _calls_passing(obj: object, run: Any) -> tuple[Any, list[tuple[str, str]]]:
    """``run()``'s result, and every call of a package function that received ``obj`` as an
    argument (or local), as (the nearest package caller's module, the callee's module)."""
    calls: list[tuple[str, str]] = []

    def package_module(frame: FrameType | None) -> str:
        while frame is not None and layer_of(frame.f_globals.get("__name__", "")) is None:
            frame = frame.f_back
        return "" if frame is None else frame.f_globals["__name__"]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or layer_of(frame.f_globals.get("__name__", "")) is None:
            return
        if any(v is obj for v in frame.f_locals.values()):
            calls.append((package_module(frame.f_back), frame.f_globals["__name__"]))

    sys.setprofile(profile)
    try:
        result = run()
    finally:
        sys.setprofile(None)
    return result, calls


def test_a_tier_section_goes_down_to_its_store_and_catalog(tmp_path):
    """The NVMe section, from the engine's builders to the worker's store and the
    scheduler's catalog: every call that hands it on goes to the caller's layer or below."""
    from vllm_kvtier.config import parse_config
    from vllm_kvtier.engine.lower import make_planners, make_workers
    from vllm_kvtier.metrics import Counters
    from vllm_kvtier.tiers.cpu import CPUPool
    from vllm_kvtier.transfer.slots import SlotTable

    cfg = parse_config({"nvme": {"path": str(tmp_path), "capacity_bytes": 1 << 30}})
    section, counters = cfg.nvme, Counters()
    slots = SlotTable(CPUPool(2, (4096,), pin=False, prefault=False))
    workers, to_store = _calls_passing(section, lambda: make_workers(cfg, namespace="ns", rank=0, slots=slots,
                                                                      counters=counters))
    try:
        assert workers["nvme"].store is not None
    finally:
        workers["nvme"].close()
    _, to_catalog = _calls_passing(section, lambda: make_planners(
        cfg, namespace="ns", world_size=1, block_bytes_per_rank=4096, counters=counters))
    for calls in (to_store, to_catalog):
        assert ("vllm_kvtier.engine.lower", "vllm_kvtier.tiers.spec") in calls or (
            "vllm_kvtier.engine.lower", "vllm_kvtier.tiers.nvme.spec") in calls
        assert not climbs(calls), climbs(calls)
    assert ("vllm_kvtier.tiers.nvme.spec", "vllm_kvtier.tiers.nvme.store") in to_store
