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
from pathlib import Path

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
    # takes its deltas and answers), beside tiers (the connector hands it the listing)
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
        "from vllm_kvtier.plan.scheduler import SchedulerPlanner\n"
        "p = SchedulerPlanner(parse_config({}), block_size=16, num_slots=8, slot_bytes_total=1)\n"
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
