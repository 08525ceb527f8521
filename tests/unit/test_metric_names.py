"""Every metric name the package uses is declared once, in :mod:`vllm_kvtier.metrics`.

The scan reads every module of ``vllm_kvtier`` with ``ast``. It finds each call of
``add``, ``set_gauge`` and ``observe`` on a ``counters`` object (``counters.add``,
``self.counters.add``). The metric there must be a member of the enum of its kind
(``CounterName`` for ``add``, ``GaugeName`` for ``set_gauge``, ``HistogramName`` for
``observe``). A string is refused: it is what let an undeclared name vanish before. A
variable is allowed only at the sites listed in ``VARIABLE_SITES``: mypy checks its type
there. Any ``CounterName.X`` anywhere (a tuple, a dict key) must name a declared member.

At run time an undeclared name raises at once, and every declared name is exported under
the Prometheus name that operators' dashboards use (``vllm:kvtier_<name>``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from vllm_kvtier.exporter import PromMetrics
from vllm_kvtier.metrics import CounterName, Counters, GaugeName, HistogramName

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "vllm_kvtier"

#: method of Counters -> the enum its metric comes from
KINDS = {"add": CounterName, "set_gauge": GaugeName, "observe": HistogramName}
ENUMS = {e.__name__: e for e in KINDS.values()}

#: (module, function) -> where the metric variable there comes from. A new variable site
#: fails the scan: name a member at the call instead, or list it here with its source.
VARIABLE_SITES: dict[tuple[str, str], str] = {
    ("plan/chunk_feed.py", "take_slice"): "RescanDelta.counts: dict[CounterName, int]",
    ("transfer/tier_io.py", "report"): "a tuple of CounterName members",
}


@dataclass
class Scan:
    calls: int = 0
    problems: list[str] = field(default_factory=list)
    variable_sites: set[tuple[str, str]] = field(default_factory=set)


def _on_counters(func: ast.expr) -> str | None:
    """The Counters method ``func`` calls (``counters.add``, ``x.counters.observe``), or None."""
    if not isinstance(func, ast.Attribute) or func.attr not in KINDS:
        return None
    owner = func.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    return func.attr if name == "counters" else None


def _member(node: ast.expr) -> tuple[str, str] | None:
    """(enum, member) for ``CounterName.X`` and the like, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ENUMS:
        return node.value.id, node.attr
    return None


def scan_module(rel: str, source: str, scan: Scan) -> None:
    """Add the metric uses of module ``rel`` (path under the package) to ``scan``."""

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        found = _member(node) if isinstance(node, ast.expr) else None
        if found and found[1] not in ENUMS[found[0]].__members__:
            scan.problems.append(f"{where}: {found[0]}.{found[1]} is not declared")
        method = _on_counters(node.func) if isinstance(node, ast.Call) else None
        if isinstance(node, ast.Call) and method is not None:
            scan.calls += 1
            arg = node.args[0] if node.args else None
            want = KINDS[method].__name__
            if arg is not None and (m := _member(arg)):
                if m[0] != want:
                    scan.problems.append(f"{where}: {method}() takes a {want}, got {m[0]}.{m[1]}")
            elif isinstance(arg, ast.Name):
                scan.variable_sites.add((rel, function))
            else:
                shown = ast.unparse(arg) if arg is not None else "nothing"
                scan.problems.append(f"{where}: {method}() takes a {want} member, got {shown}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")


def scan_package() -> Scan:
    scan = Scan()
    for path in sorted(PKG.rglob("*.py")):
        scan_module(path.relative_to(PKG).as_posix(), path.read_text(), scan)
    return scan


def test_every_call_site_names_a_declared_metric():
    scan = scan_package()
    assert scan.calls >= 80, f"the scan found only {scan.calls} call sites: is it still reading them?"
    assert scan.problems == []
    assert scan.variable_sites == set(VARIABLE_SITES)


def test_the_scan_catches_each_kind_of_mistake():
    source = (
        "def f(self, counters, name):\n"
        "    counters.add(CounterName.BLOCKS_LOADED, 'cpu')\n"  # fine
        "    self.counters.set_gauge(GaugeName.USAGE_BYTES, 'cpu', 1)\n"  # fine
        "    counters.add('blocks_loaded', 'cpu')\n"  # a string, even a declared one
        "    self.counters.add(CounterName.NOT_DECLARED, 'cpu')\n"  # not a member
        "    self.counters.observe(GaugeName.USAGE_BYTES, 'cpu', 1.0)\n"  # the wrong kind
        "    counters.add(f'{name}', 'cpu')\n"  # a computed string
        "    counters.add(name, 'cpu')\n"  # a variable, at an unlisted site
        "    extra = {GaugeName.NOT_DECLARED: 1}\n"  # not a member, outside a call
        "    other.add('x')\n"  # not on counters: ignored
    )
    scan = Scan()
    scan_module("plan/synthetic.py", source, scan)
    assert scan.calls == 7
    assert [p.split(": ", 1)[1] for p in scan.problems] == [
        "add() takes a CounterName member, got 'blocks_loaded'",
        "CounterName.NOT_DECLARED is not declared",
        "observe() takes a HistogramName, got GaugeName.USAGE_BYTES",
        "add() takes a CounterName member, got f'{name}'",
        "GaugeName.NOT_DECLARED is not declared",
    ]
    assert scan.variable_sites == {("plan/synthetic.py", "f")}


def test_an_undeclared_name_raises_at_once():
    c = Counters()
    with pytest.raises(ValueError, match="not_a_metric"):
        c.add("not_a_metric", "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        c.add("not_a_metric", "cpu", 0)  # type: ignore[arg-type]  # even when nothing is added
    with pytest.raises(ValueError):
        c.set_gauge(CounterName.BLOCKS_LOADED, "cpu", 1)  # type: ignore[arg-type]  # the wrong kind
    with pytest.raises(ValueError):
        c.observe(GaugeName.USAGE_BYTES, "cpu", 1.0)  # type: ignore[arg-type]
    assert c.drain() is None  # nothing was recorded
    c.add(CounterName.BLOCKS_LOADED, "cpu", 2)
    c.set_gauge(GaugeName.USAGE_BYTES, "nvme", 7)
    c.observe(HistogramName.REQUEST_LOADED_BLOCKS, "s3", 4)
    assert c.drain() == {"counters": {"blocks_loaded|cpu": 2}, "gauges": {"usage_bytes|nvme": 7},
                         "histograms": {"request_loaded_blocks|s3": [4]}}


def exported_names() -> set[str]:
    """The sample names vLLM's ``/metrics`` shows for every declared metric, fed once."""
    registry = CollectorRegistry()
    metrics = PromMetrics(prefix="vllm:kvtier_", registry=registry)
    metrics.observe({
        "counters": {f"{m}|cpu": 1 for m in CounterName},
        "gauges": {f"{m}|cpu": 1 for m in GaugeName},
        "histograms": {f"{m}|cpu": [1.0] for m in HistogramName},
    })
    return {s.name for family in registry.collect() for s in family.samples if s.labels.get("tier") == "cpu"}


def test_every_declared_name_is_exported_with_its_prometheus_name():
    names = exported_names()
    for m in CounterName:
        assert f"vllm:kvtier_{m}_total" in names, m
    for m in GaugeName:
        assert f"vllm:kvtier_{m}" in names, m
    for m in HistogramName:
        assert {f"vllm:kvtier_{m}_{s}" for s in ("bucket", "sum", "count")} <= names, m


def test_units_are_spelt_out_in_names():
    """Prometheus naming: base units in full (``_seconds``, ``_per_second``), not ``_s``."""
    for m in (*CounterName, *GaugeName, *HistogramName):
        assert not re.search(r"_(s|ms|us|per_s|sec|secs)(_|$)", str(m)), m


def test_every_name_on_the_metrics_page_is_still_exported():
    """Dashboards and alerts use the names docs/metrics.md shows: none may disappear."""
    names = exported_names()
    families = {n.removesuffix(s) for n in names for s in ("_bucket", "_sum", "_count") if n.endswith(s)}
    page = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"vllm:kvtier_[a-z0-9_]*[a-z0-9]", page))
    assert len(documented) > 50
    assert documented - names - families == set()
