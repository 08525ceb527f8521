"""A real ``mooncake_master`` on 127.0.0.1 for tests, and a raw Mooncake client for fault
drills.

Import the fixture into a test module (``from testkit.mooncake_server import mooncake_master``).
It starts one master per module (ready in about 1 s) on free ports, RPC and metrics bound to
127.0.0.1, and stops it afterwards. Clients use ``P2PHANDSHAKE`` metadata (transfer engines
handshake directly), so no metadata server runs. Each client contributes its own DRAM
segment to the pool; leaving the pool (``close``) takes about 2 s.

Skips, with the reason, when the mooncake package or libibverbs is missing: run
``tools/setup-remote.sh`` (the test command does).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.s3_server import free_port


def _import_problem() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "the mooncake package is not installed (run tools/setup-remote.sh)"
    try:
        import mooncake.store  # noqa: F401  - needs libibverbs.so.1 too
    except ImportError as e:
        return f"mooncake.store does not import ({e}); run tools/setup-remote.sh"
    return None


SKIP_REASON = _import_problem()
requires_mooncake = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

MiB = 1 << 20


def master_binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"


class MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1:<port>; :meth:`stop` (or :meth:`kill`) and
    :meth:`start` again reuse the port (a restarted master is empty; clients still running
    remount their segments on it, see :meth:`mounted_segments`)."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.log_path = log_dir / f"mooncake-master-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        binary = master_binary()
        if not os.access(binary, os.X_OK):
            binary.chmod(0o755)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it until stopped
        try:
            self.proc = subprocess.Popen(
                [str(binary), "-rpc_address=127.0.0.1", f"-rpc_port={self.port}",
                 "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}",
                 "-enable_metric_reporting=false", f"-log_dir={self.log_dir}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not answer within {timeout_s} s: {self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """The master dies without notice (SIGKILL), as on a crashed or lost host."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(5)
        self.proc = None

    def mounted_segments(self) -> dict[str, int]:
        """Segment (``host:port`` of its client) -> bytes, of the segments mounted on the
        master now, from its metrics endpoint; {} while it does not answer."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                text = r.read().decode(errors="replace")
        except OSError:
            return {}
        out: dict[str, int] = {}
        for line in text.splitlines():  # segment_total_capacity_bytes{segment="127.0.0.1:1234"} 67108864
            if line.startswith('segment_total_capacity_bytes{segment="'):
                name, _, value = line.removeprefix('segment_total_capacity_bytes{segment="').partition('"} ')
                out[name] = int(float(value))
        return out

    def wait_for_segments(self, n: int, timeout_s: float) -> bool:
        """Whether at least ``n`` segments were mounted within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while len(self.mounted_segments()) < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def config(self, **overrides: Any) -> Any:
        """A MooncakeConfig for this master, sized for tests (small segment and arena)."""
        from vllm_kvtier.tiers.mooncake.store import MooncakeConfig

        kw: dict[str, Any] = dict(
            master=self.address, local_hostname="127.0.0.1", global_segment_bytes=64 * MiB,
            local_buffer_bytes=4 * MiB, transfer_buffer_bytes=8 * MiB, deadline_s=2.0, io_threads=2,
        )
        kw.update(overrides)
        return MooncakeConfig(**kw)

    def raw_client(self) -> contextlib.AbstractContextManager[Any]:
        return raw_client(self.address)


@contextlib.contextmanager
def raw_client(master: str) -> Iterator[Any]:
    """A plain MooncakeDistributedStore in the pool of ``master`` (no segment of its own),
    for fault drills: ``upsert`` overwrites a value, ``get`` reads one back as bytes."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 * MiB, "tcp", "", master)
    assert rc == 0, f"raw client setup failed ({rc})"
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One mooncake_master for the module."""
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    master.start()
    try:
        yield master
    finally:
        master.stop()
