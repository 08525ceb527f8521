"""The check of the alert rules: a rule on GPU KV usage and one on swapping."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

from vllm_kvtier.config.files import read_small_file
from vllm_kvtier.doctor.base import Check, Status

#: what an alert rule must watch, and substrings of the metrics that show it
ALERT_SIGNALS = {
    "GPU KV usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "swapping": ("kvtier_blocks_loaded", "kvtier_blocks_stored", "swap_in", "swap_out", "num_preemptions"),
}
#: An alert rules file is a few KiB; a cluster's whole PrometheusRule set, a few MiB.
MAX_RULES_BYTES = 16 << 20


def _alert_exprs(value: Any) -> Iterator[str]:
    """The ``expr`` of every mapping with an ``alert`` key. Each node is visited once, so
    YAML aliases that repeat a node many times cost no more than the node itself."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if not isinstance(v, dict | list) or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            if "alert" in v and isinstance(v.get("expr"), str):
                yield v["expr"]
            stack.extend(reversed(list(v.values())))
        else:
            stack.extend(reversed(v))


def check_alerting(rules_path: str | None) -> Check:
    if rules_path is None:
        return Check("alerting", Status.WARN, "no --prometheus-rules file: swap and GPU KV usage alerts not verified")
    try:
        docs = list(yaml.safe_load_all(read_small_file(rules_path, MAX_RULES_BYTES)))
    except ValueError as e:  # not a small regular UTF-8 file
        return Check("alerting", Status.FAIL, f"--prometheus-rules: {e}")
    except (yaml.YAMLError, RecursionError) as e:  # RecursionError: nested thousands deep
        why = " ".join(str(e).split()) or "nested too deeply"
        return Check("alerting", Status.FAIL, f"--prometheus-rules {rules_path}: not valid YAML: {why}")
    exprs = [e for d in docs for e in _alert_exprs(d)]
    if not exprs:
        return Check("alerting", Status.FAIL, f"{rules_path} holds no alert rule (alert + expr)")
    missing = [sig for sig, metrics in ALERT_SIGNALS.items() if not any(n in e for e in exprs for n in metrics)]
    if missing:
        return Check("alerting", Status.WARN, f"{len(exprs)} alert rules, none on {' or '.join(missing)}")
    return Check("alerting", Status.PASS, f"{len(exprs)} alert rules in {rules_path}, on GPU KV usage and swapping")
