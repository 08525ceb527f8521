"""Where each request's time to first token goes, read inside a vLLM API server
(``bench/serving.py --timeline``).

vLLM's histograms (queue time, prefill time) start at the moment the engine's busy loop
queues a request, and its TTFT starts at the front end's arrival: what lies between, and how
many requests each step carried, they do not say. With ``--timeline`` each server process
(the front end and the engine core) imports :func:`install` at start-up, through
``bench/timeline_hook/sitecustomize.py`` on its ``PYTHONPATH``, and appends JSON lines to
the file named by ``KVTIER_BENCH_TIMELINE``:

- ``recv``: the engine's input thread took the request (``EngineCoreProc.preprocess_add_request``);
- ``sched``: one ``Scheduler.schedule`` call: tokens scheduled, requests running and waiting
  before and after, the KV cache's use;
- ``step``: one engine step, its start and end;
- ``fin``: a finished request, as the front end saw it: arrival, queued, scheduled, first
  token in the engine, first token in the front end.

Every time is ``time.monotonic()`` (one clock for all processes of a host; the front end's
wall-clock arrival and first-token times are converted with its own offset). A benchmark
instrument only: it wraps four vLLM methods of the pinned version, and when one is missing
it writes a ``missing`` record and wraps the rest (:func:`summarize` then says so).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
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
    ("kv_wait", "queued to first scheduled (waiting for KV space or its turn)"),
    ("prefill", "first scheduled to the first token in the engine (loads and compute, own and shared)"),
    ("back", "first token in the engine to the front end"),
)


class _Writer:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def __call__(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec | {"pid": os.getpid()}) + "\n"
        with self.lock, open(self.path, "a") as f:
            f.write(line)


def _patch_stats(m: ModuleType, w: _Writer) -> None:
    orig = m.IterationStats.update_from_finished_request

    def wrapped(self: Any, finish_reason: Any, request_id: str, num_prompt_tokens: int,
                max_tokens_param: Any, req_stats: Any, *a: Any, **k: Any) -> Any:
        off = time.time() - time.monotonic()
        s = req_stats
        w({"k": "fin", "id": request_id, "arrival": s.arrival_time - off, "queued": s.queued_ts,
           "sched": s.scheduled_ts, "first": s.first_token_ts,
           "first_seen": s.arrival_time + (s.first_token_latency or 0.0) - off, "prompt": num_prompt_tokens})
        return orig(self, finish_reason, request_id, num_prompt_tokens, max_tokens_param, req_stats, *a, **k)

    m.IterationStats.update_from_finished_request = wrapped


def _patch_core(m: ModuleType, w: _Writer) -> None:
    pre = m.EngineCoreProc.preprocess_add_request
    step = m.EngineCore.step

    def preprocess_add_request(self: Any, request: Any) -> Any:
        t = time.monotonic()
        out = pre(self, request)
        w({"k": "recv", "id": request.request_id, "t": t})
        return out

    def timed_step(self: Any) -> Any:
        t0 = time.monotonic()
        out = step(self)
        w({"k": "step", "t0": t0, "t1": time.monotonic(), "ran": bool(out[1])})
        return out

    m.EngineCoreProc.preprocess_add_request = preprocess_add_request
    m.EngineCore.step = timed_step


def _patch_scheduler(m: ModuleType, w: _Writer) -> None:
    orig = m.Scheduler.schedule

    def schedule(self: Any, *a: Any, **k: Any) -> Any:
        waiting, running, known = len(self.waiting), len(self.running), len(self.requests)
        out = orig(self, *a, **k)
        w({"k": "sched", "t": time.monotonic(), "tokens": out.total_num_scheduled_tokens,
           "reqs": len(out.num_scheduled_tokens), "new": len(out.scheduled_new_reqs),
           "waiting_before": waiting, "running_before": running,
           # finished requests whose blocks a connector still holds (saves in flight)
           "held": known - waiting - running,
           "waiting": len(self.waiting), "running": len(self.running),
           "kv_usage": self.kv_cache_manager.usage})
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

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
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
    recv = {r["id"]: r["t"] for r in records if r["k"] == "recv"}
    phases: dict[str, list[float]] = {p: [] for p, _ in PHASES}
    ttft: list[float] = []
    for f in (r for r in records if r["k"] == "fin"):
        # the engine's id is the front end's with a suffix ("cmpl-…-0" -> "cmpl-…-0-9d4d3da8")
        t_recv = recv.get(f["id"])
        if t_recv is None:
            t_recv = next((t for rid, t in recv.items() if rid.startswith(f["id"] + "-")), None)
        if t_recv is None or not f["sched"] or not f["first"]:
            continue
        marks = (f["arrival"], t_recv, f["queued"], f["sched"], f["first"], f["first_seen"])
        for (p, _), a, b in zip(PHASES, marks[:-1], marks[1:], strict=True):
            phases[p].append((b - a) * 1000)
        ttft.append((f["first_seen"] - f["arrival"]) * 1000)
    sched = [r for r in records if r["k"] == "sched" and r["tokens"] > 0]
    steps = [r for r in records if r["k"] == "step" and r["ran"]]
    out: dict[str, Any] = {
        "requests": len(ttft),
        "missing": sorted({r["module"] for r in records if r["k"] == "missing"}),
        "ttft_ms": _mean(ttft),
        "phases_ms": {p: {"mean": _mean(v), "median": statistics.median(v) if v else None}
                      for p, v in phases.items()},
        "steps": len(steps),
    }
    if sched:
        out["running_mean"] = _mean(r["running"] for r in sched)
        out["held_mean"] = _mean(r["held"] for r in sched)
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
                 + f", held {s['held_mean']:.2f}, KV use {s['kv_usage_mean']:.2f}")
    if "step_ms_max" in s:
        line += f", longest step {s['step_ms_max']:.0f} ms"
    if s["missing"]:
        line += f"; NOT wrapped (another vLLM?): {', '.join(s['missing'])}"
    return line
