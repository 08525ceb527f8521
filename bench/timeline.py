"""Where each request's time to first token goes, read inside a vLLM API server
(``bench/serving.py --timeline``).

vLLM's histograms (queue time, prefill time) start at the moment the engine's busy loop
queues a request, and its TTFT starts at the front end's arrival: what lies between, and how
many requests each step carried, they do not say. With ``--timeline`` each server process
(the front end and the engine core) imports :func:`install` at start-up, through
``bench/timeline_hook/sitecustomize.py`` on its ``PYTHONPATH``, and appends JSON lines to
the file named by ``KVTIER_BENCH_TIMELINE``:

- ``recv``: the engine's input thread took the request (``EngineCoreProc.preprocess_add_request``),
  with the engine's id and the front end's;
- ``sched``: one ``Scheduler.schedule`` call: tokens scheduled, requests running, waiting,
  loading asynchronously and held after it, the KV cache's use;
- ``load``: a request entered vLLM's ``WAITING_FOR_REMOTE_KVS`` (a connector loads its KV
  asynchronously; vLLM schedules it, and records it scheduled, once the load is done);
- ``step``: one engine step, its start and end;
- ``fin``: a finished request, as the front end saw it: arrival, queued, scheduled, first
  token in the engine, first token in the front end.

Every time is ``time.monotonic()`` (one clock for all processes of a host; the front end's
wall-clock arrival and first-token times are converted with its own offset). A benchmark
instrument only: it wraps vLLM methods of the pinned version. When one is missing it writes
a ``missing`` record and wraps the rest; a wrapper that fails while recording writes an
``error`` record once and leaves vLLM's call as it was (:func:`summarize` says both).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import inspect
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "KVTIER_BENCH_TIMELINE"
HOOK_DIR = Path(__file__).resolve().parent / "timeline_hook"

#: the phases of a request's time to first token, in order (ms in the summary)
PHASES = (
    ("to_engine", "arrival in the front end to the engine's input thread"),
    ("step_wait", "taken by the input thread to queued (the engine queues new requests between steps)"),
    ("kv_wait", "queued to first scheduled or to an asynchronous load's start (waiting for KV space "
                "or its turn)"),
    ("async_load", "an asynchronous load's start to first scheduled (0 for synchronous loads)"),
    ("prefill", "first scheduled to the first token in the engine (synchronous loads, compute, own and "
                "shared)"),
    ("back", "first token in the engine to the front end"),
)


class _Writer:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.failed: set[str] = set()

    def __call__(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec | {"pid": os.getpid()}) + "\n"
        with self.lock, open(self.path, "a") as f:
            f.write(line)

    def guard(self, where: str, record: Callable[[], None]) -> None:
        """Run one recording; never let it break the vLLM call it sits in."""
        try:
            record()
        except Exception as e:  # noqa: BLE001 (an instrument: report once, never raise into vLLM)
            if where not in self.failed:
                self.failed.add(where)
                with contextlib.suppress(Exception):
                    self({"k": "error", "where": where, "error": repr(e)})


def _patch_stats(m: ModuleType, w: _Writer) -> None:
    orig = m.IterationStats.update_from_finished_request
    sig = inspect.signature(orig)
    if not {"request_id", "req_stats"} <= set(sig.parameters):
        raise AttributeError(f"update_from_finished_request{sig} has no request_id or req_stats")

    def wrapped(self: Any, *a: Any, **k: Any) -> Any:
        def record() -> None:
            args = sig.bind(self, *a, **k).arguments
            s = args["req_stats"]
            off = time.time() - time.monotonic()
            w({"k": "fin", "id": args["request_id"], "arrival": s.arrival_time - off, "queued": s.queued_ts,
               "sched": s.scheduled_ts, "first": s.first_token_ts,
               "first_seen": s.arrival_time + (s.first_token_latency or 0.0) - off})

        w.guard("fin", record)
        return orig(self, *a, **k)

    m.IterationStats.update_from_finished_request = wrapped


def _patch_core(m: ModuleType, w: _Writer) -> None:
    pre = m.EngineCoreProc.preprocess_add_request

    def preprocess_add_request(self: Any, request: Any) -> Any:
        t = time.monotonic()
        out = pre(self, request)
        # the front end's id, which its "fin" record carries (the engine's adds a suffix)
        w.guard("recv", lambda: w({"k": "recv", "id": request.request_id,
                                   "ext": getattr(request, "external_req_id", None), "t": t}))
        return out

    def timed(step: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def timed_step(self: Any) -> Any:
            t0 = time.monotonic()
            out = step(self)
            w.guard("step", lambda: w({"k": "step", "t0": t0, "t1": time.monotonic(), "ran": bool(out[1])}))
            return out
        return timed_step

    m.EngineCoreProc.preprocess_add_request = preprocess_add_request
    # step_with_batch_queue: the engine's step under async scheduling or pipeline stages
    m.EngineCore.step = timed(m.EngineCore.step)
    m.EngineCore.step_with_batch_queue = timed(m.EngineCore.step_with_batch_queue)


def _patch_scheduler(m: ModuleType, w: _Writer) -> None:
    orig = m.Scheduler.schedule
    remote = m.RequestStatus.WAITING_FOR_REMOTE_KVS

    def schedule(self: Any, *a: Any, **k: Any) -> Any:
        out = orig(self, *a, **k)

        def record() -> None:
            t = time.monotonic()
            # waiting requests that hold KV blocks: loading asynchronously, or skipped
            holding = list(getattr(self, "kv_holding_waiting", ()))
            loading = [r for r in holding if r.status == remote]
            seen = self.__dict__.setdefault("_kvtier_timeline_loading", set())
            for r in loading:
                if r.request_id not in seen:
                    w({"k": "load", "id": r.request_id, "t": t})
            seen.clear()
            seen.update(r.request_id for r in loading)
            waiting, running = len(self.waiting) + len(holding), len(self.running)
            w({"k": "sched", "t": t, "tokens": out.total_num_scheduled_tokens,
               "reqs": len(out.num_scheduled_tokens), "new": len(out.scheduled_new_reqs),
               "waiting": waiting, "running": running, "loading": len(loading),
               # finished requests whose blocks a connector still holds (saves in flight)
               "held": len(self.requests) - waiting - running,
               "kv_usage": self.kv_cache_manager.usage})

        w.guard("sched", record)
        return out

    m.Scheduler.schedule = schedule


PATCHES: dict[str, Callable[[ModuleType, _Writer], None]] = {
    "vllm.v1.metrics.stats": _patch_stats,
    "vllm.v1.engine.core": _patch_core,
    "vllm.v1.core.sched.scheduler": _patch_scheduler,
}


class _Finder(importlib.abc.MetaPathFinder):
    """Runs a module's patch right after the module itself is executed."""

    def __init__(self, w: _Writer) -> None:
        self.w = w
        self.inside = threading.local()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(name)
        if patch is None or getattr(self.inside, "name", None) == name:
            return None
        self.inside.name = name  # the lookup below comes back here: let the other finders answer
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.inside.name = None
        if spec is None or spec.loader is None:
            return spec
        inner, w = spec.loader, self.w

        class Loader(importlib.abc.Loader):
            def create_module(self, s: Any) -> Any:
                return inner.create_module(s)

            def exec_module(self, module: ModuleType) -> None:
                inner.exec_module(module)
                try:
                    patch(module, w)
                except AttributeError as e:  # another vLLM: record it, leave the module as is
                    w({"k": "missing", "module": name, "error": str(e)})

        spec.loader = Loader()
        return spec


def install(path: str) -> None:
    """Wrap the vLLM methods above in this process as their modules are imported."""
    sys.meta_path.insert(0, _Finder(_Writer(path)))


def read(path: Path) -> list[dict[str, Any]]:
    """The records of one server (an empty list when the file is missing); a torn last line
    (the server killed mid-write) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _mean(v: Iterable[float]) -> float | None:
    v = list(v)
    return statistics.fmean(v) if v else None


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase of :data:`PHASES`, the mean and median ms over the requests both the front
    end and the engine recorded; per step, the requests running after it was scheduled
    (mean over steps and weighted by the steps' time), the held requests, and the longest
    step. ``missing`` lists the wraps that did not apply (then some figures are absent)."""
    phases: dict[str, list[float]] = {p: [] for p, _ in PHASES}
    ttft: list[float] = []
    # In file order: a request's "recv" (and "load") is written before its "fin"; the front
    # end's id names the latest request of that id (a client may reuse ids across rounds).
    recv: dict[str, tuple[str, float]] = {}  # front end's id -> (engine's id, time)
    load: dict[str, float] = {}  # engine's id -> first asynchronous load's start
    for f in records:
        if f["k"] == "recv":
            recv[f.get("ext") or f["id"]] = (f["id"], f["t"])
            load.pop(f["id"], None)
            continue
        if f["k"] == "load":
            load.setdefault(f["id"], f["t"])
            continue
        if f["k"] != "fin":
            continue
        got = recv.get(f["id"])
        if got is None or not f["sched"] or not f["first"]:
            continue
        engine_id, t_recv = got
        t_load = load.get(engine_id)
        t_load = t_load if t_load is not None and f["queued"] <= t_load <= f["sched"] else f["sched"]
        marks = (f["arrival"], t_recv, f["queued"], t_load, f["sched"], f["first"], f["first_seen"])
        for (p, _), a, b in zip(PHASES, marks[:-1], marks[1:], strict=True):
            phases[p].append((b - a) * 1000)
        ttft.append((f["first_seen"] - f["arrival"]) * 1000)
    sched = [r for r in records if r["k"] == "sched" and r["tokens"] > 0]
    steps = [r for r in records if r["k"] == "step" and r["ran"]]
    out: dict[str, Any] = {
        "requests": len(ttft),
        "missing": sorted({r["module"] for r in records if r["k"] == "missing"}
                          | {f"{r['where']}: {r['error']}" for r in records if r["k"] == "error"}),
        "ttft_ms": _mean(ttft),
        "phases_ms": {p: {"mean": _mean(v), "median": statistics.median(v) if v else None}
                      for p, v in phases.items()},
        "steps": len(steps),
    }
    if sched:
        out["running_mean"] = _mean(r["running"] for r in sched)
        out["held_mean"] = _mean(r["held"] for r in sched)
        out["loading_mean"] = _mean(r.get("loading", 0) for r in sched)
        out["kv_usage_mean"] = _mean(r["kv_usage"] for r in sched)
    if steps:
        out["step_ms_max"] = max(s["t1"] - s["t0"] for s in steps) * 1000
        if len(steps) == len(sched):  # one schedule per step that ran: weight running by step time
            secs = [s["t1"] - s["t0"] for s in steps]
            out["running_time_weighted"] = sum(r["running"] * d for r, d in zip(sched, secs, strict=True)) / sum(secs)
    return out


def describe(s: dict[str, Any]) -> str:
    """One line of :func:`summarize`'s figures."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    parts = [f"{p} {ms(s['phases_ms'][p]['mean'])}" for p, _ in PHASES]
    line = (f"{s['requests']} requests, mean ms: " + ", ".join(parts) + f" (TTFT {ms(s['ttft_ms'])}); "
            f"{s['steps']} steps")
    if "running_mean" in s:
        line += (f", running {s['running_mean']:.2f} per step"
                 + (f" ({s['running_time_weighted']:.2f} weighted by time)" if "running_time_weighted" in s else "")
                 + f", loading {s['loading_mean']:.2f}, held {s['held_mean']:.2f}, KV use {s['kv_usage_mean']:.2f}")
    if "step_ms_max" in s:
        line += f", longest step {s['step_ms_max']:.0f} ms"
    if s["missing"]:
        line += f"; NOT wrapped (another vLLM?): {', '.join(s['missing'])}"
    return line
