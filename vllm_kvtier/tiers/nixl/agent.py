"""A small NIXL agent for DRAM -> DRAM transfers between processes.

It is the peer path of prefill/decode disaggregation. The decode side reads blocks
straight out of the prefill side's CPU pool over UCX. UCX uses RDMA where present, and
TCP, shared memory or cross-memory attach on one host.

Who calls it: the worker half, one agent per TP rank, from one thread (NIXL agents are
created without thread synchronisation). Construction creates the UCX backend (~0.4 s).
It, :meth:`NixlAgent.register` and :meth:`NixlAgent.close` block briefly. ``submit_*``
post a transfer and return. Completions come back through :meth:`NixlAgent.poll`, like
the chunk stores.

The exchange goes out of band. vLLM carries it in a request's ``kv_transfer_params``.
An example::

    prefill:  agent = NixlAgent("prefill-r0"); agent.register(pool)   # once, at start
              params = agent.peer_info().to_dict()                      # JSON-safe
    decode:   agent.add_peer(PeerInfo.from_dict(params))
              agent.submit_read(job, "prefill-r0", [(local_addr, remote_addr, nbytes), ...],
                                notif=b"req-42")
              agent.poll() -> [XferResult(job, ok=True, ...)]
    prefill:  agent.get_notifs() -> {"decode-r0": [b"req-42"]}          # free those blocks.

Trust: the agent metadata is NIXL's own opaque blob (parsed by NIXL, not by pickle).
Descriptors are built here from integers checked against the regions the peer published.
NIXL's ``get_serialized_descs``/``deserialize_descs`` pickle, so they are never used: what
a peer sends is data, not code.

Failures: every transfer ends in one :class:`XferResult`. A peer whose process is gone
fails at once (``peer_gone``). A transfer still in progress at its deadline is aborted and
fails (``deadline``). So a frozen or unreachable peer costs one deadline, never a hang.
After a failed READ the destination bytes are undefined.

Some machines' libibverbs has provider plugins but no RDMA NIC. There a process that used
UCX can crash at exit: a libnl clash between UCX's bundled copy and the system's.
Setting ``UCX_MODULES=^ib`` in the environment before the first agent avoids it. That is
a deployment setting (leave it unset on RDMA hosts), so this module does not set it.
"""

from __future__ import annotations

import base64
import importlib
import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from vllm_kvtier import cpus
from vllm_kvtier.config.stores import NixlConfig

__all__ = ["AGENT_CREATION", "INSTALL_HINT", "NixlAgent", "NixlConfig", "PeerInfo", "Region", "XferResult", "nixl_api"]

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "NIXL transfers need the nixl package: pip install nixl-cu12 (and `pip install --no-deps nixl` "
    "for the `nixl` import name); tools/setup-remote.sh installs both for tests"
)

#: (local address, remote address, bytes) of one contiguous piece of a transfer.
Span = tuple[int, int, int]


@dataclass(frozen=True)
class Region:
    """A registered range of this process's memory."""

    addr: int
    nbytes: int

    def contains(self, addr: int, nbytes: int) -> bool:
        return nbytes > 0 and self.addr <= addr and addr + nbytes <= self.addr + self.nbytes


@dataclass(frozen=True)
class PeerInfo:
    """What an agent publishes so that another can transfer to and from its regions."""

    name: str
    #: NIXL agent metadata (connection info and memory keys), opaque to us.
    metadata: bytes
    regions: tuple[Region, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (``kv_transfer_params`` travel as JSON)."""
        return {
            "name": self.name,
            "metadata": base64.b64encode(self.metadata).decode("ascii"),
            "regions": [[r.addr, r.nbytes] for r in self.regions],
        }

    @classmethod
    def from_dict(cls, d: Any) -> PeerInfo:
        """Parse :meth:`to_dict`'s form; ValueError on anything else (it comes off the wire)."""
        try:
            name, md, regions = d["name"], d["metadata"], d["regions"]
            if not isinstance(name, str) or not name or not isinstance(md, str):
                raise ValueError("name and metadata must be non-empty strings")
            pairs = [(int(a), int(n)) for a, n in regions]
            if any(a <= 0 or n <= 0 for a, n in pairs):
                raise ValueError("regions must have positive addresses and sizes")
            return cls(name, base64.b64decode(md, validate=True), tuple(Region(a, n) for a, n in pairs))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a NIXL peer description: {e}") from e


@dataclass(frozen=True)
class XferResult:
    job_id: int
    ok: bool
    #: "" when ok; else bad_request, peer_gone, unknown_peer, transfer_error, deadline,
    #: closed or error.
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(eq=False)
class _Pending:
    job_id: int
    handle: Any
    nbytes: int
    deadline: float
    t0: float


def nixl_api() -> Any:
    """NIXL's Python API module (``nixl._api`` or a variant's). The ``nixl`` meta package
    picks the CUDA variant from ``torch.version.cuda`` and so imports torch (~3 s); a vLLM
    worker has torch loaded already, so ask it then. Otherwise (tools, tests) take the
    installed variant directly, cu12 first: its OBJ plugin also loads on machines without a
    GPU. ImportError with the install hint when none imports."""
    order = ["nixl", "nixl_cu12", "nixl_cu13"] if "torch" in sys.modules else ["nixl_cu12", "nixl_cu13", "nixl"]
    errors = []
    for name in order:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError(f"{INSTALL_HINT} ({'; '.join(errors)})")


#: Held while creating a NIXL agent: NIXL's plugin manager is process-wide, and the P/D
#: agents and the I/O engines' agents may be created from different threads.
AGENT_CREATION = threading.Lock()


def _nixl_api() -> tuple[Any, Any]:
    api = nixl_api()
    return api.nixl_agent, api.nixl_agent_config


def _reason(e: BaseException) -> str:
    kind = type(e).__name__
    if "Disconnect" in kind:
        return "peer_gone"
    if "NotFound" in kind:
        return "unknown_peer"
    return "error"


class NixlAgent:
    """One NIXL agent; see the module doc for the protocol and the failure semantics."""

    def __init__(self, name: str, config: NixlConfig | None = None) -> None:
        nixl_agent, nixl_agent_config = _nixl_api()
        self.name = name
        self.config = config or NixlConfig()
        conf = nixl_agent_config(enable_prog_thread=self.config.progress_thread,
                                 backends=list(self.config.backends), num_threads=self.config.num_threads)
        try:
            with AGENT_CREATION, cpus.background_threads(fallback_all=True):  # its threads start here
                self._agent = nixl_agent(name, conf)
        except Exception as e:
            raise RuntimeError(f"NIXL agent {name!r} with backends {self.config.backends} failed: {e}") from e
        missing = [b for b in self.config.backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(f"NIXL backends {missing} are not available here "
                               f"(plugins found: {self._agent.get_plugin_list()})")
        self._regions: dict[Region, tuple[Any, Any]] = {}  # region -> (registration, the memory's owner)
        self._peers: dict[str, tuple[Region, ...]] = {}
        self._pending: list[_Pending] = []
        self._done: list[XferResult] = []
        self._closed = False

    # ---- memory and peers ----------------------------------------------------------------------

    def register(self, memory: Any) -> Region:
        """Register host memory (a contiguous CPU tensor, numpy array, bytearray, mmap or any
        writable buffer) for transfers. The agent keeps a reference until :meth:`deregister`.
        Publish :meth:`peer_info` after the last registration: peers learn regions from it.

        Remote access: NIXL's Python API (``register_memory(reg_list, mem_type, backends)``,
        nixl 1.5) has no access-mode flag, so UCX registers the range for remote READ and
        WRITE. A peer only ever READs it here; whoever holds :meth:`peer_info` and reaches
        this host over UCX could write it, so that metadata goes to the P/D proxy only
        (``nixl.accept_remote_decode``, the shared secret; docs/security.md)."""
        addr, nbytes = _host_range(memory)
        region = Region(addr, nbytes)
        if region in self._regions:
            return region
        reg = self._agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
        self._regions[region] = (reg, memory)
        return region

    def deregister(self, region: Region) -> None:
        entry = self._regions.pop(region, None)
        if entry is not None:
            self._agent.deregister_memory(entry[0])

    def peer_info(self) -> PeerInfo:
        return PeerInfo(self.name, bytes(self._agent.get_agent_metadata()), tuple(self._regions))

    def add_peer(self, info: PeerInfo) -> None:
        """Load a peer's metadata (again, if it changed). Raises ValueError if NIXL reads
        another agent's name from it than ``info.name``."""
        if info.name in self._peers:
            self.remove_peer(info.name)
        got = self._agent.add_remote_agent(info.metadata)
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != info.name:
            self._agent.remove_remote_agent(got)
            raise ValueError(f"peer metadata names agent {got!r}, expected {info.name!r}")
        self._peers[info.name] = info.regions

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect; its transfers in flight fail (``peer_gone``)."""
        if self._peers.pop(name, None) is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            logger.warning("kvtier nixl: removing peer %s: %s", name, e)

    def peers(self) -> list[str]:
        return list(self._peers)

    # ---- transfers -----------------------------------------------------------------------------

    def submit_read(self, job_id: int, peer: str, spans: Sequence[Span], *, notif: bytes = b"") -> None:
        """Read each span's ``nbytes`` at the peer's ``remote address`` into ours. ``notif``
        reaches the peer's :meth:`get_notifs` once the whole read is done."""
        self._submit("READ", job_id, peer, spans, notif)

    def submit_write(self, job_id: int, peer: str, spans: Sequence[Span], *, notif: bytes = b"") -> None:
        """Write each span's ``nbytes`` from ours to the peer's ``remote address``."""
        self._submit("WRITE", job_id, peer, spans, notif)

    def notify(self, peer: str, notif: bytes) -> bool:
        """Send ``notif`` alone to ``peer``'s :meth:`get_notifs` (no transfer); False if it
        could not be sent (logged)."""
        if self._closed or peer not in self._peers:
            return False
        try:
            self._agent.send_notif(peer, notif)
        except Exception as e:  # the peer is gone
            logger.warning("kvtier nixl: notification to %s failed: %s", peer, _reason(e))
            return False
        return True

    def _submit(self, op: Literal["READ", "WRITE"], job_id: int, peer: str, spans: Sequence[Span],
                notif: bytes) -> None:
        t0 = time.perf_counter()
        if self._closed:
            self._done.append(XferResult(job_id, False, "closed"))
            return
        why = self._check(peer, spans)
        if why:
            logger.warning("kvtier nixl: %s job %d refused: %s", op, job_id, why)
            self._done.append(XferResult(job_id, False, "bad_request"))
            return
        local = np.array([(s[0], s[2], 0) for s in spans], dtype=np.uint64)
        remote = np.array([(s[1], s[2], 0) for s in spans], dtype=np.uint64)
        nbytes = sum(s[2] for s in spans)
        try:
            handle = self._agent.initialize_xfer(
                op, self._agent.get_xfer_descs(local, "DRAM"), self._agent.get_xfer_descs(remote, "DRAM"),
                peer, notif,
            )
        except Exception as e:
            self._fail(job_id, _reason(e), e, t0)
            return
        try:
            state = self._agent.transfer(handle)
        except Exception as e:
            self._release(handle)
            self._fail(job_id, _reason(e), e, t0)
            return
        p = _Pending(job_id, handle, nbytes, time.monotonic() + self.config.deadline_s, t0)
        if not self._settle(p, state):
            self._pending.append(p)

    def _check(self, peer: str, spans: Sequence[Span]) -> str:
        remote = self._peers.get(peer)
        if remote is None:
            return f"unknown peer {peer!r}"
        if not spans:
            return "no spans"
        for la, ra, n in spans:
            if not any(r.contains(la, n) for r in self._regions):
                return f"local range {la:#x}+{n} is not in a registered region"
            if not any(r.contains(ra, n) for r in remote):
                return f"remote range {ra:#x}+{n} is not in a region {peer} published"
        return ""

    def poll(self) -> list[XferResult]:
        """Transfers finished since the last poll, and those past their deadline (aborted,
        failed with ``deadline``). Never blocks."""
        still = []
        for p in self._pending:
            try:
                state = self._agent.check_xfer_state(p.handle)
            except Exception as e:
                self._release(p.handle)
                self._fail(p.job_id, _reason(e), e, p.t0)
                continue
            if not self._settle(p, state):
                still.append(p)
        self._pending = still
        out, self._done = self._done, []
        return out

    def _settle(self, p: _Pending, state: str) -> bool:
        """Record ``p``'s outcome if it has one now; False if it is still in progress."""
        if state == "DONE":
            self._release(p.handle)
            self._done.append(XferResult(p.job_id, True, nbytes=p.nbytes, seconds=time.perf_counter() - p.t0))
            return True
        if state == "PROC" and time.monotonic() < p.deadline:
            return False
        self._release(p.handle)  # ERR, or past the deadline: releasing aborts it
        reason = "deadline" if state == "PROC" else "transfer_error"
        self._fail(p.job_id, reason, None, p.t0)
        return True

    def _fail(self, job_id: int, reason: str, e: BaseException | None, t0: float) -> None:
        logger.warning("kvtier nixl: transfer %d failed (%s)%s", job_id, reason, f": {e}" if e else "")
        self._done.append(XferResult(job_id, False, reason, seconds=time.perf_counter() - t0))

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as e:  # NIXL keeps a handle it cannot cancel and frees it with the agent
            logger.warning("kvtier nixl: releasing a transfer handle: %s", e)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent's name."""
        if self._closed:
            return {}
        return {str(k): list(v) for k, v in self._agent.get_new_notifs().items()}

    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Abort transfers in flight (reported as ``closed`` by a last :meth:`poll`),
        deregister memory and disconnect from peers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for p in self._pending:
            self._release(p.handle)
            self._done.append(XferResult(p.job_id, False, "closed", seconds=time.perf_counter() - p.t0))
        self._pending = []
        if not self.config.progress_thread:
            # Nobody else progresses UCX: let it finish what it started (errors of a gone
            # peer's endpoint included) before the endpoints go; destroying one with work
            # still queued aborts the process inside UCX.
            for _ in range(20):
                try:
                    self._agent.get_new_notifs()
                except Exception:
                    break
                time.sleep(0.005)
        for name in list(self._peers):
            self.remove_peer(name)
        for region in list(self._regions):
            try:
                self.deregister(region)
            except Exception as e:
                logger.warning("kvtier nixl: deregistering %s: %s", region, e)


def _host_range(memory: Any) -> tuple[int, int]:
    """(address, bytes) of contiguous host memory."""
    if hasattr(memory, "data_ptr") and hasattr(memory, "is_contiguous"):  # a torch tensor
        if memory.device.type != "cpu" or not memory.is_contiguous():
            raise ValueError("register a contiguous CPU tensor")
        return int(memory.data_ptr()), int(memory.numel() * memory.element_size())
    view = memoryview(memory)
    if not view.contiguous:
        raise ValueError("register contiguous memory")
    arr = np.frombuffer(view, dtype=np.uint8)
    if arr.nbytes == 0:
        raise ValueError("register a non-empty range")
    return int(arr.ctypes.data), int(arr.nbytes)
