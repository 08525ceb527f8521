"""NIXL as the I/O engine of the NVMe tier and of the object tier.

The NVMe tier uses its POSIX or GDS backend (``nvme.io_engine``). The object tier uses its
OBJ backend (``s3.io_engine``).

Each class here only moves bytes between a host buffer and a file range or an object. The
stores keep everything else: file names and renames, syncs, headers, CRC32 checks,
retries, breaker, deadlines. So the stored bytes are the same whichever engine wrote them.
See :mod:`~vllm_kvtier.tiers.nvme.file_io` (the file contract) and
:class:`~vllm_kvtier.tiers.s3.object_io.ObjectIO` (the object contract).

Who calls it: the stores' I/O threads, several at once. A file engine call blocks its
thread until the transfer ended. An object engine call blocks until it ended or reached
its deadline. Construction creates a NIXL agent and its backend (~10 ms for POSIX, ~0.25 s
for OBJ). A missing ``nixl`` package or a plugin that does not load is a
:class:`~vllm_kvtier.errors.ConfigError`. It names the config field and gives the install
hint.

Threads: a NIXL agent made without thread synchronisation must be used by one thread at a
time. The file engines keep a pool of such agents (one per concurrently busy thread).
Linux AIO submits buffered writes synchronously inside ``transfer``. So one shared, locked
agent would serialise the I/O threads. The object engine shares one agent created with
NIXL's strict thread synchronisation. An OBJ transfer is posted to aws-sdk-cpp's own
thread pool and returns at once. So the lock is held only briefly. One agent means one S3
client and one connection pool.

Memory: every call registers its buffer and its file range or object key. It deregisters
them afterwards (~0.15 ms each; our transfers are MiBs). An OBJ transfer still in progress
at its deadline cannot be cancelled. Releasing NIXL's handle does not stop aws-sdk-cpp,
which would go on writing into, or reading from, the buffer. So the engine keeps the
handle, the registrations and a view of the buffer until NIXL reports it ended. The buffer
then cannot return to the pool: :class:`~vllm_kvtier.tiers.nvme.store.AlignedBuffer`
refuses to pool memory that still has a view. It is freed once the engine lets go of it.

What NIXL's OBJ backend does not tell us, and how it is handled:

* Why a transfer failed. A failed GET is diagnosed with one HEAD through the store's boto3
  client. Gone: ``missing``. Shorter than the range: ``truncated``. Endpoint down: the
  connection error. A failed PUT, or a GET the HEAD does not explain, raises
  :class:`NixlTransferError`. It counts as ``unavailable`` and is retried within the
  deadline.
* A short object. A ranged GET past the end of an object reports success and leaves the
  rest of the buffer as it was. The CRC32 of every block decides, as always. A checksum
  failure is also diagnosed with a HEAD, so a short object reads as ``truncated``.
* Timeouts. aws-sdk-cpp has its own (connect, request, retries), not configurable through
  NIXL: ~50 s against a dead endpoint. The store's deadline cuts them short, as above.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from vllm_kvtier.chunkformat import ChunkFormatError
from vllm_kvtier.errors import ConfigError, FailureReason
from vllm_kvtier.tiers.nixl.agent import AGENT_CREATION, INSTALL_HINT, nixl_api
from vllm_kvtier.tiers.s3.config import S3Config

__all__ = ["PIECE_BYTES", "NixlGdsFileIO", "NixlObjectIO", "NixlPosixFileIO", "NixlTransferError", "obj_params"]

logger = logging.getLogger(__name__)

#: File transfers are split into pieces of this size, all posted at once: on an NVMe
#: device with O_DIRECT, several AIO requests in flight keep its queues busy.
PIECE_BYTES = 4 << 20

#: Agents whose backend still had OBJ transfers in flight at close: destroying them would
#: block until aws-sdk-cpp gives up (~50 s against a dead endpoint), so they live until the
#: process exits, and are never destroyed (see :meth:`NixlObjectIO.close`).
_KEPT_AGENTS: list[Any] = []


#: File agents whose transfer failed, with what they held (registrations, the buffer):
#: never reused nor freed (see :meth:`NixlFileIO._transfer`). A failed local disk transfer
#: is rare; each costs one agent and one chunk buffer.
_RETIRED: list[Any] = []


class NixlTransferError(ConnectionError):
    """NIXL reported a failed transfer and gave no reason we could find."""


def _api(field: str) -> Any:
    try:
        return nixl_api()
    except ImportError as e:
        raise ConfigError(field, f"needs the nixl package, which does not import: {e}") from e


def _address(view: memoryview) -> int:
    """The address of a contiguous buffer (the numpy array exporting it is dropped at once,
    so the caller's ``with view`` can release it)."""
    arr = np.frombuffer(view, dtype=np.uint8)
    addr = int(arr.ctypes.data)
    del arr
    return addr


def _run(agent: Any, handle: Any, deadline: float | None) -> Literal["DONE", "PROC"]:
    """Post ``handle`` and poll it until it is done (``DONE``) or ``deadline`` passed.

    At the deadline it may still be in progress (``PROC``). Raises NIXL's error if it
    failed. NIXL has no blocking wait, so this polls. First a few times with a bare yield
    (a 256 KiB O_DIRECT write takes ~0.1 ms). Then it sleeps 50 us, doubling to 0.5 ms. So
    a waiting thread neither takes a core from the transfer nor adds more than ~2% to a
    32 MiB one (Python's sleep releases the GIL)."""
    state = agent.transfer(handle)
    polls = 0
    pause = 25e-6
    while state == "PROC":
        if deadline is not None and time.monotonic() >= deadline:
            return "PROC"
        polls += 1
        if polls > 8:
            pause = min(2 * pause, 5e-4)
        time.sleep(0 if polls <= 8 else pause)
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise NixlTransferError(f"NIXL transfer ended in state {state}")
    return "DONE"


def _quietly(fn: Callable[[], Any], what: str) -> None:
    try:
        fn()
    except Exception as e:  # NIXL keeps what it could not free and frees it with the agent
        logger.warning("kvtier nixl: %s: %s", what, e)


# ---- files (nvme.io_engine) ---------------------------------------------------------------


class NixlFileIO:
    """A :class:`~vllm_kvtier.tiers.nvme.file_io.FileIO` over a NIXL file backend (POSIX or GDS).
    See the module doc for threads and memory."""

    def __init__(self, backend: str, name: str) -> None:
        self.name = name
        self.backend = backend
        self._api = _api("nvme.io_engine")
        self._lock = threading.Lock()
        with AGENT_CREATION:  # fails here, at start-up, if the plugin is absent
            self._idle: list[Any] = [self._new_agent(startup=True)]

    def _new_agent(self, *, startup: bool = False) -> Any:
        api = self._api
        agent = api.nixl_agent(f"kvtier-{self.name}-{uuid.uuid4().hex[:8]}",
                               api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        try:
            agent.create_backend(self.backend, {})
        except Exception as e:
            if not startup:
                raise
            raise ConfigError(
                "nvme.io_engine",
                f"{self.name!r} needs NIXL's {self.backend} plugin, which does not load here ({type(e).__name__}: "
                f"{e}; plugins present: {', '.join(agent.get_plugin_list())}); use 'posix' or 'nixl'",
            ) from e
        return agent

    def _take(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        with AGENT_CREATION:  # NIXL's plugin manager is process-wide: one agent made at a time
            return self._new_agent()

    def _give(self, agent: Any) -> None:
        with self._lock:
            self._idle.append(agent)

    def write(self, fd: int, view: memoryview, offset: int) -> None:
        try:
            self._transfer("WRITE", fd, view, offset)
        except NixlTransferError as e:
            st = os.fstatvfs(fd)
            if st.f_bavail * st.f_frsize < view.nbytes:
                raise OSError(errno.ENOSPC, f"No space left on device (NIXL {self.backend}: {e})") from e
            raise OSError(errno.EIO, f"NIXL {self.backend} write failed: {e}") from e

    def read_into(self, fd: int, view: memoryview, offset: int) -> None:
        # NIXL fails a short read without saying so; the store's posix path says "truncated".
        size = os.fstat(fd).st_size
        if size < offset + view.nbytes:
            raise ChunkFormatError(f"truncated: read {max(0, size - offset)} of {view.nbytes} bytes", FailureReason.TRUNCATED)
        try:
            self._transfer("READ", fd, view, offset)
        except NixlTransferError as e:
            raise OSError(errno.EIO, f"NIXL {self.backend} read failed: {e}") from e

    def _transfer(self, op: Literal["READ", "WRITE"], fd: int, view: memoryview, offset: int) -> None:
        n = view.nbytes
        addr = _address(view)
        starts = range(0, n, PIECE_BYTES)
        local = np.array([(addr + s, min(PIECE_BYTES, n - s), 0) for s in starts], dtype=np.uint64)
        remote = np.array([(offset + s, min(PIECE_BYTES, n - s), fd) for s in starts], dtype=np.uint64)
        agent = self._take()
        undo = contextlib.ExitStack()  # unwinds: release, deregister file, deregister buffer
        try:
            for kind, desc in (("DRAM", (addr, n, 0, "")), ("FILE", (offset, n, fd, ""))):
                reg = agent.register_memory([desc], kind, backends=[self.backend])
                undo.callback(_quietly, functools.partial(agent.deregister_memory, reg), "deregistering")
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "FILE"), agent.name)
            undo.callback(_quietly, handle.release, "releasing a transfer")
            _run(agent, handle, None)  # a disk transfer always ends: no deadline
        except Exception as e:
            # NIXL's POSIX backend reports an error while other pieces of the transfer may
            # still be queued in its I/O queue: a late one could land in this buffer after
            # it went back to the pool, or run on a released handle. So nothing is undone:
            # the agent, its registrations and the buffer are retired for good.
            keep = view[:]  # holds the buffer out of the pool
            _RETIRED.append((agent, undo.pop_all(), keep))
            if isinstance(e, NixlTransferError):
                raise
            raise NixlTransferError(f"{type(e).__name__}: {e}") from e
        undo.close()
        self._give(agent)

    def close(self) -> None:
        with self._lock:
            self._idle.clear()


def NixlPosixFileIO() -> NixlFileIO:  # noqa: N802 - a factory named like the class it makes
    """``nvme.io_engine: nixl``."""
    return NixlFileIO("POSIX", "nixl")


def NixlGdsFileIO() -> NixlFileIO:  # noqa: N802
    """``nvme.io_engine: nixl-gds``."""
    return NixlFileIO("GDS", "nixl-gds")


# ---- objects (s3.io_engine) ---------------------------------------------------------------


def obj_params(config: S3Config, threads: int) -> dict[str, str]:
    """The OBJ backend's parameters for ``config``. No credentials: aws-sdk-cpp reads them
    from its default chain (environment, shared files with AWS_PROFILE, web identity,
    instance metadata) and refreshes temporary ones itself."""
    p = {
        "bucket": config.bucket,
        "use_virtual_addressing": "false" if config.path_style else "true",
        # Plain Content-Length bodies, as our boto3 client sends: aws-sdk-cpp's default
        # (aws-chunked with a checksum trailer) is mangled or very slow on several
        # S3-compatible servers. Every block carries its own CRC32 anyway.
        "req_checksum": "required",
        "resp_checksum": "required",
        "num_threads": str(threads),
    }
    if config.endpoint_url is not None:
        p["endpoint_override"] = config.endpoint_url
        p["scheme"] = "http" if config.endpoint_url.startswith("http://") else "https"
    if config.region is not None:
        p["region"] = config.region
    if config.ca_bundle is not None:
        p["ca_bundle"] = config.ca_bundle
    return p


@dataclass(eq=False)
class _Unfinished:
    """An OBJ transfer past its deadline, kept until NIXL says it ended (see the module doc)."""

    handle: Any
    #: releases the handle, the registrations and the view of the buffer
    free: contextlib.ExitStack


class NixlObjectIO:
    """An :class:`~vllm_kvtier.tiers.s3.object_io.ObjectIO` over NIXL's OBJ backend: whole-object
    PUTs and (ranged) GETs straight between a host buffer and the bucket.

    ``size_of(key)``: the object's size by one HEAD through the store's boto3 client
    (raising botocore's error for a missing key or an unreachable endpoint); used only to
    explain a failure. ``on_request(op)``: called with ``PutObject`` / ``GetObject`` as each
    request is posted (the store's request counters; aws-sdk-cpp's own retries are not
    visible through NIXL)."""

    name = "nixl"

    def __init__(self, config: S3Config, size_of: Callable[[str], int],
                 on_request: Callable[[str], None] | None = None) -> None:
        api = _api("s3.io_engine")
        self._size_of = size_of
        self._on_request = on_request
        self._dev = itertools.count(1)  # OBJ descriptors are told apart by devId
        self._lock = threading.Lock()
        self._unfinished: list[_Unfinished] = []
        #: aws-sdk-cpp's threads for this backend: past this many unfinished transfers, a
        #: new one would only queue behind them and time out too.
        self._max_unfinished = 2 * config.io_threads
        conf = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                     sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        with AGENT_CREATION:
            agent = api.nixl_agent(f"kvtier-s3-{uuid.uuid4().hex[:8]}", conf)
            try:
                # Both directions' threads may have a request in flight at once.
                agent.create_backend("OBJ", obj_params(config, 2 * config.io_threads))
            except Exception as e:
                raise ConfigError(
                    "s3.io_engine",
                    f"'nixl' needs NIXL's OBJ plugin, which does not start here ({type(e).__name__}: {e}; plugins "
                    f"present: {', '.join(agent.get_plugin_list())}; the nixl-cu13 build's OBJ plugin needs "
                    f"libcuobjclient, {INSTALL_HINT}); use 'boto3'",
                ) from e
        self._agent: Any = agent

    def put(self, key: str, view: memoryview, deadline: float) -> None:
        self._transfer("WRITE", key, 0, view, deadline)

    def get_into(self, key: str, start: int | None, view: memoryview, deadline: float) -> None:
        """A ranged GET (``start`` None: from 0; the store kernel then checks the header read
        along and every block). A failed one is explained by a HEAD (``truncated``)."""
        offset = start or 0
        try:
            self._transfer("READ", key, offset, view, deadline)
        except NixlTransferError as e:
            self._explain(key, offset + view.nbytes, e)
            raise

    def _explain(self, key: str, end: int, e: Exception) -> None:
        """Raise what a HEAD says about a failed GET (gone, unreachable, too short); return
        if it says nothing."""
        size = self._size_of(key)
        if size < end:
            raise ChunkFormatError(f"truncated: the object has {size} of {end} bytes", FailureReason.TRUNCATED) from e

    def _transfer(self, op: Literal["READ", "WRITE"], key: str, offset: int, view: memoryview,
                  deadline: float) -> None:
        agent, n, dev = self._agent, view.nbytes, next(self._dev)
        if agent is None:
            raise NixlTransferError("the engine is closed")
        self._reap()
        with self._lock:
            stuck = len(self._unfinished)
        if stuck >= self._max_unfinished:
            raise NixlTransferError(f"{stuck} earlier transfers are still in flight past their deadline")
        addr = _address(view)
        try:
            with contextlib.ExitStack() as undo:  # unwinds: release, deregister object, deregister buffer
                for kind, desc in (("DRAM", (addr, n, 0, "")), ("OBJ", (offset, n, dev, key))):
                    reg = agent.register_memory([desc], kind, backends=["OBJ"])
                    undo.callback(_quietly, functools.partial(agent.deregister_memory, reg), "deregistering")
                handle = agent.initialize_xfer(op, agent.get_xfer_descs([(addr, n, 0)], "DRAM"),
                                               agent.get_xfer_descs([(offset, n, dev)], "OBJ"), agent.name)
                undo.callback(_quietly, handle.release, "releasing a transfer")
                if self._on_request is not None:
                    self._on_request("PutObject" if op == "WRITE" else "GetObject")
                if _run(agent, handle, deadline) == "PROC":
                    keep = view[:]  # holds the buffer out of the pool until the transfer ended
                    undo.callback(keep.release)
                    with self._lock:
                        self._unfinished.append(_Unfinished(handle, undo.pop_all()))
                    raise TimeoutError(f"NIXL OBJ {op} of {key} still in progress at the deadline")
        except (NixlTransferError, TimeoutError):
            raise
        except Exception as e:  # nixlBackendError and friends
            raise NixlTransferError(f"{op} of {key}: {type(e).__name__}: {e}") from e

    def _reap(self) -> None:
        """Free what unfinished transfers held, for those that ended meanwhile."""
        agent = self._agent
        with self._lock:
            if not self._unfinished or agent is None:  # closed: what is held stays held
                return
            items, self._unfinished = self._unfinished, []
        still = []
        for u in items:
            try:
                ended = agent.check_xfer_state(u.handle) != "PROC"  # "ERR" is an end too
            except Exception:  # says nothing about the transfer: keep holding its buffer
                ended = False
            if ended:
                u.free.close()
            else:
                still.append(u)
        with self._lock:
            self._unfinished.extend(still)

    def unfinished(self) -> int:
        """Transfers past their deadline that NIXL has not finished yet (their buffers are held)."""
        self._reap()
        with self._lock:
            return len(self._unfinished)

    def close(self) -> None:
        """Free the agent; one that still has unfinished transfers is kept until the process
        exits (destroying it would block until aws-sdk-cpp gives up on them). Idempotent."""
        if self._agent is None:
            return
        if self.unfinished():
            logger.warning("kvtier s3: %d NIXL transfer(s) still in flight at close; their buffers stay held",
                           len(self._unfinished))
            kept = (self._agent, self._unfinished)
            _KEPT_AGENTS.append(kept)
            # One reference nobody will drop: the interpreter's shutdown then never runs
            # the agent's destructor, which would wait for aws-sdk-cpp to give up.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))
        self._agent = None
