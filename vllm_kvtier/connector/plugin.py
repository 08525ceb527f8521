"""The plugin's entry point and what this vLLM version offers.

Who calls it: vLLM (:func:`register`, in every process, as it loads general plugins) and
:mod:`vllm_kvtier.connector` (the version shims). Nothing here runs per step.
"""

from __future__ import annotations

import json
import logging

from vllm_kvtier.config import parse_config
from vllm_kvtier.errors import ConfigError

try:  # vLLM >= 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM reports through get_finished only
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:  # the hybrid KV cache manager's connector interface (request_finished_all_groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - a vLLM without it never turns the manager on for us

    class SupportsHMA:  # type: ignore[no-redef]
        """Stand-in: vLLM without ``SupportsHMA`` calls ``request_finished`` only."""

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover
    CacheHitSource = None  # type: ignore[assignment,misc]

CONNECTOR_NAME = "KVTierConnector"


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the handlers the ``vllm`` logger has *now*, at vLLM's level.

    vLLM configures, and may reconfigure, its logging after plugins are loaded. Nothing is
    handed when vLLM's logging is not configured (``VLLM_CONFIGURE_LOGGING=0``). The record
    still propagates to the application's root handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if target.handlers and record.levelno >= target.getEffectiveLevel():
            target.handle(record)


def route_logs_to_vllm() -> None:
    """Send the plugin's log lines where vLLM's go, in vLLM's format and at its level.

    The plugin logs under ``vllm_kvtier``, outside vLLM's ``vllm`` logger tree: without
    this its INFO lines (tiers and namespace at start, blocks found after a restart,
    load-or-recompute verdicts) are dropped and its warnings reach stderr only through
    Python's last-resort handler. Idempotent. The ``vllm_kvtier`` logger keeps
    propagating, so handlers an application put on the root logger see the lines too.
    """
    ours = logging.getLogger("vllm_kvtier")
    if any(isinstance(h, _ToVllmHandlers) for h in ours.handlers):
        return
    ours.addHandler(_ToVllmHandlers())
    if ours.level == logging.NOTSET:  # an operator's own setting wins
        import vllm.envs as envs

        ours.setLevel(logging.getLevelName(str(envs.VLLM_LOGGING_LEVEL).upper()))


def check_command_line_config() -> None:
    """Refuse a bad ``kv_connector_extra_config`` given on vLLM's command line at once.

    vLLM builds the connector only after the model is loaded (minutes for a real model).
    It then reports a typo inside hundreds of lines and several tracebacks. vLLM loads
    general plugins first of all, as it builds its argument parser. So :func:`register`
    reads ``--kv-transfer-config`` from the command line of a vLLM entry point itself
    (``vllm serve``, ``python -m vllm.entrypoints...``). It does so in the main process
    only. The flag may name this connector with an extra config that does not parse. Then
    it prints the one-line error naming the field and exits with status 2. Anything it
    cannot read is left to vLLM and to the connector's own check at start. That covers
    other forms of the flag, bad JSON and another connector.
    """
    import multiprocessing
    import os
    import sys

    argv = sys.argv
    if not argv or "vllm" not in os.path.basename(argv[0]) + os.path.dirname(argv[0]).replace(os.sep, "/") \
            or multiprocessing.parent_process() is not None:
        return
    raw = None
    for i, arg in enumerate(argv):
        if arg == "--kv-transfer-config" and i + 1 < len(argv):
            raw = argv[i + 1]
        elif arg.startswith("--kv-transfer-config="):
            raw = arg.partition("=")[2]
    if raw is None:
        return
    try:
        ktc = json.loads(raw)
    except ValueError:
        return
    if not isinstance(ktc, dict) or ktc.get("kv_connector") != CONNECTOR_NAME:
        return
    try:
        parse_config(ktc.get("kv_connector_extra_config") or {})
    except ConfigError as e:
        print(f"kvtier: --kv-transfer-config: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def register() -> None:
    """``vllm.general_plugins`` entry point.

    It makes ``{"kv_connector": "KVTierConnector"}`` work without
    ``kv_connector_module_path``. It routes the plugin's logs to vLLM's handlers. It
    refuses a bad config on the command line before vLLM loads the model. vLLM calls this
    in every process; calling it twice is harmless."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    route_logs_to_vllm()
    check_command_line_config()
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm_kvtier.connector", CONNECTOR_NAME)
