"""The Mooncake tier's data path: chunk objects in a Mooncake Store pool.

The pool is a ``mooncake_master`` plus clients that pool their DRAM.

Who calls it: the worker half (one store per TP rank), from the worker's main thread.
``submit_*`` return at once; completions come back through ``poll``. That is the
:class:`~vllm_kvtier.tiers.base.ChunkStore` contract. It is implemented once by
:class:`~vllm_kvtier.tiers.kernel.StoreKernel` (queues, deadlines, headers, the verified
read path). Mooncake's own part is the medium's byte primitives
(:class:`~vllm_kvtier.tiers.mooncake.medium.MooncakeMedium`, in :mod:`.medium`). Those are
sizes, batched puts and gets, removes, and the classifier of return codes. Here are
joining and leaving the pool, :meth:`MooncakeStore.exists`
(:class:`~vllm_kvtier.tiers.base.Probeable`), :meth:`MooncakeStore.stats`
(:class:`~vllm_kvtier.tiers.base.ReportsRemoteStats`) and the circuit breaker. The
constructor (connects to the master) and :meth:`MooncakeStore.close` block their caller.

Objects: key ``kvtier/<namespace>/r<rank>/<chunk_id>``. The value is a chunk in the format
of :mod:`~vllm_kvtier.chunkformat`. A read of a chunk this process has no header for asks
the master for the object's size first (``get_size``). The kernel bounds it by the largest
chunk this engine writes before any memory is taken. Then the whole object is read. Its
header, the key at every position and every block's CRC32 are verified. Nothing read from
the pool is ever unpickled: other clients of the pool can write any bytes under our keys.

Transfers: one page-aligned arena of ``transfer_buffer_bytes``, registered with the
client once. RDMA needs registered memory; registering per transfer would pin pages on
every call. Reads land in it (:meth:`MooncakeMedium.take_buffer`). Writes copy the
caller's chunk into it (one memory copy, cheap next to the network). The kernel hands the
medium every queued operation of one kind at once (up to ``max_batch``). They move with one
``batch_put_from`` / ``batch_get_into`` call. A read result's blocks are views into the
arena: copy them out, then ``release()`` the result.

Leases, replicas and eviction are Mooncake's. The master evicts objects when its pool is
full. A read of an evicted chunk fails with ``missing`` (a miss). A put of a key that
exists keeps the stored object (ids name their content). Deletes use ``force``. A plain
remove is refused while an object holds a read lease (10 s by default after each read). A
reader racing a forced delete gets bytes that fail their CRC32. That is a miss, never
wrong KV.

Failures: a read's deadline (``deadline_s``) is the kernel's. ``poll`` reports a read past
it as failed even while the client call is still blocked. With the master gone, each call
takes seconds to fail. A circuit breaker (:mod:`~vllm_kvtier.tiers.resilience`) makes
requests fail at once (``breaker_open``). It trips after ``breaker_failures`` consecutive
unhealthy calls (``unavailable``, ``transfer``, ``error``).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from typing import TYPE_CHECKING

from vllm_kvtier.chunkformat import MAX_CHUNK_BLOCKS
from vllm_kvtier.config.stores import MooncakeConfig
from vllm_kvtier.tiers.buffers import shared_pool
from vllm_kvtier.tiers.kernel import KernelSettings, KernelStore, StoreKernel
from vllm_kvtier.tiers.mooncake.medium import Arena, MooncakeMedium, code_reason, object_key
from vllm_kvtier.tiers.mooncake.spec import INSTALL_HINT
from vllm_kvtier.tiers.resilience import CircuitBreaker, RemoteStats

if TYPE_CHECKING:
    from vllm_kvtier.config.lower import MooncakeTierConfig
    from vllm_kvtier.tiers.registry import StoreContext

__all__ = ["INSTALL_HINT", "MooncakeConfig", "MooncakeMedium", "MooncakeStats", "MooncakeStore", "code_reason",
           "object_key"]

logger = logging.getLogger(__name__)

MiB = 1 << 20

#: The Mooncake store's figures (the shape every remote store reports; ``retries`` is 0).
MooncakeStats = RemoteStats


# ---- the store --------------------------------------------------------------------------------


#: Bound on the background part of close (joining I/O threads blocked in the client).
_BACKGROUND_CLOSE_S = 24 * 3600.0


class MooncakeStore(KernelStore[MooncakeMedium]):
    """The Mooncake tier's :class:`~vllm_kvtier.tiers.base.ChunkStore` for one (namespace,
    rank), also :class:`~vllm_kvtier.tiers.base.Probeable` and
    :class:`~vllm_kvtier.tiers.base.ReportsRemoteStats`. See the module doc.

    ``ctx``: the namespace, rank and block size, ``ctx.buffers`` the worker's pool (None:
    the process default; reads land in the arena, not in it). ``max_chunk_blocks``: the
    most blocks this engine puts in an object (the Mooncake tier stores one per object):
    the bound of every size the master reports.

    Raises ImportError (with an install hint) when the mooncake package or its system
    libraries are missing, and ConnectionError when the master cannot be reached or the
    client cannot join the pool."""

    def __init__(self, config: MooncakeConfig, ctx: StoreContext, *,
                 max_chunk_blocks: int = MAX_CHUNK_BLOCKS) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:  # also a missing libibverbs.so.1 (an ImportError of the extension)
            raise ImportError(f"{INSTALL_HINT} ({e})") from e
        self.config = config
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        host, port = config.master_host_port
        _probe(host, port, config.connect_timeout_s)
        self.local_hostname = config.local_hostname or _route_address(host)
        client = MooncakeDistributedStore()
        rc = client.setup(
            self.local_hostname, config.metadata_server, config.global_segment_bytes,
            config.local_buffer_bytes, config.protocol, config.device_name, config.master,
        )
        if rc != 0:
            raise ConnectionError(f"mooncake: joining the pool of master {config.master} failed (rc {rc})")
        arena = Arena(config.transfer_buffer_bytes)
        rc = client.register_buffer(arena.addr, arena.nbytes)
        if rc != 0:
            client.close()
            arena.close()
            raise ConnectionError(f"mooncake: registering the {arena.nbytes} B transfer buffer failed (rc {rc})")
        replicate = ReplicateConfig()
        replicate.replica_num = config.replicas
        medium = MooncakeMedium(client, arena, prefix=object_key(ctx.namespace, ctx.rank, ""), replicate=replicate,
                                breaker=self.breaker, max_batch=config.max_batch)
        self._closer: threading.Thread | None = None
        settings = KernelSettings(ctx.namespace, ctx.rank, ctx.block_bytes, max_chunk_blocks,
                                  read_deadline_s=config.deadline_s,
                                  io_threads=config.io_threads, write_threads=config.io_threads,
                                  max_queued_writes=config.max_queued_writes)
        kernel = StoreKernel(medium, settings, buffers=ctx.buffers or shared_pool(), auth=ctx.auth)
        super().__init__(medium, kernel)
        logger.info("kvtier mooncake: joined master %s as %s over %s (segment %d B)", config.master,
                    self.local_hostname, config.protocol, config.global_segment_bytes)

    @classmethod
    def from_config(cls, section: MooncakeTierConfig, ctx: StoreContext) -> MooncakeStore:
        """The registry's constructor (:mod:`~vllm_kvtier.tiers.registry`): ``section``
        is ``cfg.mooncake``. With ``ctx.lookup_only`` (the scheduler, which only asks what
        exists) it is a pure client: no pool memory of its own, one I/O thread."""
        config = section.store
        if ctx.lookup_only:
            config = dataclasses.replace(config, global_segment_bytes=0, transfer_buffer_bytes=1 << 20, io_threads=1)
        return cls(config, ctx, max_chunk_blocks=section.chunk_blocks)

    def __repr__(self) -> str:
        return (f"MooncakeStore(master={self.config.master!r}, protocol={self.config.protocol!r}, "
                f"namespace={self.namespace!r}, rank={self.rank})")

    def key(self, chunk_id: str) -> str:
        """The chunk's object key in the pool (for tools and fault drills)."""
        return self.medium.key(chunk_id)

    def exists(self, chunk_ids: list[str]) -> list[bool]:
        """Whether each chunk is in the pool now (one batch call; blocks). An error reads
        as False: a chunk that cannot be confirmed is a miss."""
        if not chunk_ids or self._closer is not None:
            return [False] * len(chunk_ids)
        rcs = self.medium.batch("batch_is_exist", [self.key(c) for c in chunk_ids])
        return [rc == 1 for rc in rcs]

    def stats(self) -> MooncakeStats:
        failures = {str(reason): n for reason, n in self.op_stats().failures.items()}
        return MooncakeStats(self.medium.requests(), 0, failures, self.breaker.snapshot())

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued I/O, leave the pool and free the arena, waiting up to ``timeout_s``;
        what is not done by then finishes on a background (non-daemon) thread, so the
        process still exits cleanly. New work is refused from the call on. Idempotent."""
        if not self.kernel.stop_accepting():
            return
        self._closer = threading.Thread(target=self.kernel.shut_down, args=(_BACKGROUND_CLOSE_S,),
                                        name="kvtier-mooncake-close")
        self._closer.start()
        self._closer.join(timeout_s)
        if self._closer.is_alive():
            logger.warning("kvtier mooncake: still leaving the pool after %.1f s; finishing in the background",
                           timeout_s)


def _probe(host: str, port: int, timeout_s: float) -> None:
    """Fail fast when the master does not accept connections (setup would retry for 90 s)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConnectionError(f"mooncake master {host}:{port} is not reachable: {e}") from e


def _route_address(host: str) -> str:
    """The local address of the interface that routes to ``host`` (a UDP connect sends
    nothing; it only asks the kernel for the route)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
