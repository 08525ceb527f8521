"""The plugin's log lines reach vLLM's log (issue 16: they were dropped or went through
Python's last-resort handler)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(
        """
        import logging
        from vllm_kvtier.connector.plugin import register
        register()  # vLLM loads plugins before it configures its logging
        register()  # and calls it in every process, possibly twice
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging
        configure_logging(LoggingConfig())  # as an engine does at start
        logging.getLogger("vllm_kvtier.tiers.nvme.store").info("kvtier-probe-info")
        logging.getLogger("vllm_kvtier.tiers.nvme.store").debug("kvtier-probe-debug")
        """
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **env_extra}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=False)


def test_plugin_info_lines_reach_vllms_handler_in_its_format_once() -> None:
    proc = _run({})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if "kvtier-probe-info" in line]
    assert len(lines) == 1, out  # once, not once per register() call
    assert " INFO " in lines[0] and lines[0] != "kvtier-probe-info", lines[0]  # vLLM's format
    assert "kvtier-probe-debug" not in out  # vLLM's level is kept


def test_nothing_is_routed_when_the_application_owns_logging() -> None:
    proc = _run({"VLLM_CONFIGURE_LOGGING": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "kvtier-probe-info" not in proc.stdout + proc.stderr
