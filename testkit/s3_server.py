"""A real S3 server on 127.0.0.1 for tests (moto's server in a subprocess), and a small
fault-injecting HTTP proxy to put in front of it.

Import the fixtures into a test module (``from testkit.s3_server import s3_server, s3_bucket``).
``s3_server`` starts one moto server per module (about 2.5 s), sets fake AWS credentials and
region in the environment for the module's tests (and keeps the developer's own AWS config
out of them), and stops the server afterwards. moto keeps objects in its process memory and
does not give it back, so tests keep their objects small (KiBs to a few MiB).

Both skip, with the reason, when boto3 or moto[server] is not installed.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

HAVE_S3 = all(importlib.util.find_spec(m) is not None for m in ("boto3", "moto"))
SKIP_REASON = "boto3 and moto[server] are not installed (pip install --no-deps -r requirements/test.txt)"
requires_s3 = pytest.mark.skipif(not HAVE_S3, reason=SKIP_REASON)

#: Fake credentials, distinctive so a test can look for them in reprs and logs.
ACCESS_KEY_ID = "AKIAKVTIERTESTKEYID0"
SECRET_ACCESS_KEY = "kvtier-test-secret-DO-NOT-LOG-7f3a9c"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_tls_files(d: Path) -> tuple[Path, Path, Path]:
    """A private CA and a server certificate it signed for 127.0.0.1 (what an on-prem S3
    with its own CA looks like). Returns (ca.pem, server.pem, server.key)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    span = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def cert(subject: str, key: Any, issuer: str, signer: Any, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(span[0]).not_valid_after(span[1])
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            import ipaddress

            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("kvtier test CA", ca_key, "kvtier test CA", ca_key, True)
    srv = cert("127.0.0.1", srv_key, "kvtier test CA", ca_key, False)
    paths = (d / "ca.pem", d / "server.pem", d / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(srv_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1:<port>; :meth:`stop` and :meth:`start` again
    reuse the port (a restarted moto is empty: buckets must be created again). With
    ``tls_dir``, it serves HTTPS with a certificate from a private CA (``self.ca_bundle``)."""

    def __init__(self, log_dir: Path, port: int | None = None, *, tls_dir: Path | None = None) -> None:
        self.port = port or free_port()
        self.tls = make_tls_files(tls_dir) if tls_dir is not None else None
        self.ca_bundle = str(self.tls[0]) if self.tls else None
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"moto-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it until stopped
        try:
            tls = ["-c", str(self.tls[1]), "-k", str(self.tls[2])] if self.tls else []
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port), *tls],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}: {self.log_tail()}")
            ctx = ssl.create_default_context(cafile=self.ca_bundle) if self.tls else None
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/", timeout=1, context=ctx):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto server did not answer within {timeout_s} s: {self.log_tail()}")
            time.sleep(0.1)

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

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def client(self) -> Any:
        """A plain boto3 client of this server (for setup and fault drills)."""
        return plain_client(self.url, self.ca_bundle)

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"kvt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def plain_client(endpoint_url: str, ca_bundle: str | None = None) -> Any:
    """A plain boto3 client (for setup and fault drills): path-style, no retries, no SDK
    checksums, credentials from the environment."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint_url, region_name=REGION, verify=ca_bundle,
                        config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1},
                                      request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


@contextlib.contextmanager
def aws_test_env() -> Iterator[None]:
    """Fake credentials and region from the environment; no shared config files, no
    instance metadata lookups."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ROLE_ARN",
                    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE"):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
        mp.setenv("AWS_DEFAULT_REGION", REGION)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto server for the module, with the AWS test environment set around it."""
    if not HAVE_S3:
        pytest.skip(SKIP_REASON)
    with aws_test_env():
        server = MotoServer(tmp_path_factory.mktemp("moto"))
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server: MotoServer) -> str:
    """A fresh, empty bucket on the module's server."""
    return s3_server.create_bucket()


# ---- fault proxy ----------------------------------------------------------------------------

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message><RequestId>kvtier-proxy</RequestId></Error>")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te", "upgrade"}


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint. Modes:

    * ``pass``: forward every request;
    * ``slowdown``: answer ``503 SlowDown`` to the next ``count`` requests (None: all), then pass;
    * ``hang``: hold each request without answering until ``hang_s`` passes or the proxy
      closes, then drop the connection;
    * ``delay``: forward every request after waiting ``delay_s`` (a slow, throttled link).
    """

    def __init__(self, upstream_url: str) -> None:
        host, port = upstream_url.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.mode = "pass"
        self.remaining: int | None = None
        self.hang_s = 30.0
        self.delay_s = 0.0
        self.seen = 0
        self.injected = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def passthrough(self) -> None:
        with self._lock:
            self.mode, self.remaining = "pass", None

    def slowdown(self, count: int | None = None) -> None:
        with self._lock:
            self.mode, self.remaining = "slowdown", count

    def hang(self, seconds: float = 30.0) -> None:
        with self._lock:
            self.mode, self.hang_s = "hang", seconds

    def delay(self, seconds: float) -> None:
        with self._lock:
            self.mode, self.delay_s = "delay", seconds

    def decide(self) -> str:
        with self._lock:
            self.seen += 1
            if self.mode == "slowdown":
                if self.remaining is None or self.remaining > 0:
                    if self.remaining is not None:
                        self.remaining -= 1
                    self.injected += 1
                    return "slowdown"
                return "pass"
            if self.mode == "hang":
                self.injected += 1
            return self.mode

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
        pass

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        what = proxy.decide()
        if what == "hang":
            proxy._closing.wait(proxy.hang_s)
            self.close_connection = True
            return
        if what == "delay":
            proxy._closing.wait(proxy.delay_s)
        if what == "slowdown":
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(_SLOWDOWN) if self.command != "HEAD" else 0))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(_SLOWDOWN)
            return
        conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except OSError:  # upstream gone: answer like a dead gateway
            self.send_response(502)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        finally:
            conn.close()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP:
                self.send_header(k, v)
        size = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
        self.send_header("Content-Length", size)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
