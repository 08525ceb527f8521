"""The object-store tier: chunk objects in an S3 bucket, or any S3-compatible endpoint
(MinIO, Ceph RGW, GCS interoperability).

Who calls it: the worker half, one store per TP rank, from the worker's main thread. The
scheduler half builds stores only to list (``scan``). :meth:`S3Store.scan` and
:meth:`S3Store.close` block their caller.

What it is: :class:`S3Store` is the :class:`~vllm_kvtier.tiers.base.ChunkStore` contract,
implemented once by :class:`~vllm_kvtier.tiers.kernel.StoreKernel`. The kernel owns the
queues, deadlines, claiming, stats, header stamping and the one verified read path. The
store is also :class:`~vllm_kvtier.tiers.base.Scannable` (:meth:`S3Store.scan`) and
:class:`~vllm_kvtier.tiers.base.ReportsRemoteStats` (:meth:`S3Store.stats`). This module
holds what is S3's above the bytes: the key layout, this writer's manifest, the request
figures and close.

Modules: the byte primitives (PUT or multipart, ranged GET, DELETE, retries, the circuit
breaker, request counts) are in :mod:`~vllm_kvtier.tiers.s3.medium`. The start-up listing
and rescans are in :mod:`~vllm_kvtier.tiers.s3.scan`. Configuration, key layout and the
failure classifier are in :mod:`~vllm_kvtier.tiers.s3.config`. Request bodies are in
:mod:`~vllm_kvtier.tiers.s3.object_io`. Retries and the breaker are in
:mod:`~vllm_kvtier.tiers.resilience`. The manifest format is in
:mod:`~vllm_kvtier.tiers.s3.manifest`.

Threads: uploads run on threads of their own (``write_threads`` = ``io_threads``). So they
never hold a load back.

Deadlines: a read's deadline (``s3.deadline_s``) counts from its submission. The kernel
reports a read past it as failed (``deadline``), even while a request is still on the
wire. So a slow endpoint is a miss, never a stall. Every failure is an
``IOResult(ok=False, reason=...)``.

Keys: ``<prefix><namespace>/r<rank>/<hh>/<object_id>.kvt``. ``hh`` is two hex characters
of a hash of the object id. So writes spread over 256 prefixes that S3 can partition
independently, instead of all landing on one. ``namespace`` digests everything that
changes the bytes (as for NVMe). So instances sharing a bucket never read incompatible KV.

Manifests: each writer keeps a manifest object
(``.../r<rank>/manifest/<writer_id>.kvm``; with a key ``<writer_id>.<tag>.kvm``, a tag
only key holders make). It holds the headers of the writer's latest
``manifest_max_entries`` writes. The writer id is stable across restarts: a digest of host
name, NVMe path, rank and namespace, or ``s3.writer_id`` (with ``-dp<engine>`` for data-parallel
engine >= 1: engines share the rank prefixes). So a restarted writer merges and replaces
its predecessor's manifest instead of adding one. The manifest is rewritten after
``manifest_every_writes`` writes, or after an eighth of its entries once that is more. So
the bytes uploaded per write stay bounded. It is rewritten at close too. Scans read the
manifests (:mod:`~vllm_kvtier.tiers.s3.scan`).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING

from vllm_kvtier.chunkformat import MAX_CHUNK_BLOCKS, ChunkHeader
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.base import ScanResult
from vllm_kvtier.tiers.buffers import shared_pool
from vllm_kvtier.tiers.kernel import KernelSettings, KernelStore, StoreKernel
from vllm_kvtier.tiers.resilience import CircuitBreaker, RemoteStats
from vllm_kvtier.tiers.s3.config import (
    MANIFEST_SUFFIX,
    S3Config,
    error_reason,
    is_transient,
    object_key,
    rank_prefix,
)
from vllm_kvtier.tiers.s3.manifest import encode_manifest, manifest_file_name, sign_manifest
from vllm_kvtier.tiers.s3.medium import S3Medium
from vllm_kvtier.tiers.s3.object_io import read_body_into
from vllm_kvtier.tiers.s3.scan import S3Scanner, ScanReport

if TYPE_CHECKING:
    from vllm_kvtier.config.lower import S3TierConfig
    from vllm_kvtier.tiers.registry import StoreContext

__all__ = [
    "S3Config",
    "S3Stats",
    "S3Store",
    "default_writer_id",
    "error_reason",
    "is_transient",
    "object_key",
    "rank_prefix",
    "read_body_into",
    "writer_id_of",
]

logger = logging.getLogger(__name__)

#: The S3 store's figures (the shape every remote store reports).
S3Stats = RemoteStats


def default_writer_id(namespace: str, rank: int, engine: int = 0, instance: str = "") -> str:
    """A writer id stable across restarts.

    It is a digest of the host name (a pod's name in Kubernetes) and what tells this
    instance from others on that host (``instance``: its NVMe path). It also covers the
    data-parallel engine, the rank and the namespace. Two instances with the same host
    name and no NVMe path of their own share it. They then take each other's chunks for
    their own; hits across instances are counted as their own. They overwrite each other's
    manifest, which costs header GETs, never correctness. Set ``s3.writer_id`` then."""
    dp = f"dp{engine}|" if engine else ""
    where = f"{socket.gethostname()}|{instance}" if instance else socket.gethostname()
    return hashlib.sha256(f"{where}|{dp}{rank}|{namespace}".encode()).hexdigest()[:16]


def writer_id_of(config: S3Config, namespace: str, rank: int, engine: int = 0, instance: str = "") -> str:
    """This store's writer id: ``s3.writer_id`` (``-dp<engine>`` added for data-parallel
    engine >= 1, whose chunks share the rank's prefix) or :func:`default_writer_id`."""
    if not config.writer_id:
        return default_writer_id(namespace, rank, engine, instance)
    return config.writer_id if engine == 0 else f"{config.writer_id}-dp{engine}"


class S3Store(KernelStore[S3Medium]):
    """The S3 tier's :class:`~vllm_kvtier.tiers.base.ChunkStore` for one (namespace, rank):
    the kernel over :class:`S3Medium`, also :class:`~vllm_kvtier.tiers.base.Scannable` and
    :class:`~vllm_kvtier.tiers.base.ReportsRemoteStats`. See the module doc."""

    def __init__(self, config: S3Config, ctx: StoreContext, *, max_chunk_blocks: int = MAX_CHUNK_BLOCKS,
                 read_deadline_s: float | None = None) -> None:
        """Builds the client and starts the threads; sends no request.

        Without boto3 it raises ImportError with the install hint. If ``s3.io_engine``
        cannot run here, a ConfigError names it. ``ctx``: the namespace, rank and block
        size. ``ctx.buffers``: the worker's read-buffer pool (None: the process default).
        ``ctx.engine``: the data-parallel engine, which names this writer
        (:func:`writer_id_of`), not its keys. ``max_chunk_blocks``: the config's
        ``chunk_blocks`` (the bound of a stored block count). ``read_deadline_s``: None is
        ``s3.deadline_s``."""
        medium = S3Medium(config, ctx.namespace, ctx.rank)
        deadline_s = config.deadline_s if read_deadline_s is None else read_deadline_s
        settings = KernelSettings(ctx.namespace, ctx.rank, ctx.block_bytes, max_chunk_blocks, deadline_s,
                                  write_deadline_s=config.deadline_s, io_threads=config.io_threads,
                                  write_threads=config.io_threads, max_queued_writes=config.max_queued_writes)
        self.config = config
        self.writer_id = writer_id_of(config, ctx.namespace, ctx.rank, ctx.engine, ctx.instance)
        self._mlock = threading.Lock()
        #: this writer's latest objects, oldest first (at most ``manifest_max_entries``)
        self._manifest: OrderedDict[str, ChunkHeader] = OrderedDict()
        self._manifest_changes = 0
        #: the predecessor's manifest (same writer id, before a restart) merged in yet?
        self._adopted = False
        #: this writer's manifest under an earlier build's name (no tag), verified as its
        #: own: deleted once the first manifest under the tagged name is written
        self._legacy_manifest: str | None = None
        self._deleted_before_adopt: set[str] = set()
        self._flush_lock = threading.Lock()
        self._closing = False
        # The manifest's state is set before the kernel's write threads start.
        kernel = StoreKernel(medium, settings, buffers=ctx.buffers or shared_pool(), auth=ctx.auth,
                             on_written=self.on_written)
        super().__init__(medium, kernel)
        #: the listing state of this store's scans (its ``scan`` and figures go there)
        self._scanner = S3Scanner(medium, block_bytes=ctx.block_bytes, max_chunk_blocks=max_chunk_blocks,
                                  auth=ctx.auth, refuses=self.refuses, own_manifest_key=self.manifest_key())

    @classmethod
    def from_config(cls, section: S3TierConfig, ctx: StoreContext) -> S3Store:
        """The registry's constructor (:mod:`~vllm_kvtier.tiers.registry`).

        ``section`` is ``cfg.s3``. ``ctx.lookup_only`` is the scheduler, which only lists
        and reads headers, always through boto3. With it no NIXL agent is made, whatever
        ``s3.io_engine`` says. The workers check that it runs."""
        config = replace(section.store, io_engine="boto3") if ctx.lookup_only else section.store
        return cls(config, ctx, max_chunk_blocks=section.chunk_blocks)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"S3Store(bucket={c.bucket!r}, prefix={c.prefix!r}, endpoint_url={c.endpoint_url!r}, "
            f"namespace={self.namespace!r}, rank={self.rank}, writer_id={self.writer_id!r}, "
            f"io_engine={c.io_engine!r})"
        )

    @property
    def breaker(self) -> CircuitBreaker:
        return self.medium.breaker

    @property
    def last_scan(self) -> ScanReport:
        """What the last :meth:`scan` found and what it cost in requests."""
        return self._scanner.last_scan

    # ---- keys ---------------------------------------------------------------------------

    def key(self, object_id: str) -> str:
        return self.medium.key(object_id)

    def manifest_key(self, writer_id: str | None = None) -> str:
        """The key of writer ``writer_id``'s manifest (None: this writer's). With a key its
        name carries a tag (:func:`~vllm_kvtier.tiers.s3.manifest.manifest_file_name`)."""
        name = manifest_file_name(writer_id or self.writer_id, self.auth, self.namespace, self.rank)
        return f"{self.medium.prefix}manifest/{name}"

    # ---- the contract, where S3 adds to the kernel ------------------------------------------

    def forget(self, chunk_ids: list[str]) -> None:
        """Chunks a rescan no longer lists leave this writer's manifest.

        They expired by lifecycle or were deleted out of band
        (:class:`~vllm_kvtier.tiers.base.Forgets`). So the manifest holds only objects that
        were still there at the last listing. It keeps no ghosts until the entry cap pushes
        them out. Ids of other writers' chunks are not in it. No request is sent; the next
        manifest rewrite carries the change."""
        with self._mlock:
            for chunk_id in chunk_ids:
                if self._manifest.pop(chunk_id, None) is not None:
                    self._manifest_changes += 1

    def submit_delete(self, chunk_id: str) -> None:
        """The kernel's, and the chunk leaves this writer's manifest."""
        with self._mlock:
            if self._manifest.pop(chunk_id, None) is not None:
                self._manifest_changes += 1
            if not self._adopted and len(self._deleted_before_adopt) < self.config.manifest_max_entries:
                self._deleted_before_adopt.add(chunk_id)
        self.kernel.submit_delete(chunk_id)

    def on_written(self, chunk_id: str, header: ChunkHeader) -> None:
        """The kernel's ``on_written``, on a write thread. The chunk goes into this writer's
        manifest, which holds its latest ``manifest_max_entries`` writes (the oldest entry
        leaves). The manifest is rewritten here, unless a flush is running. That happens
        after ``manifest_every_writes`` changes, or after an eighth of its entries once
        that is more. So the bytes uploaded stay at most
        ``max(entries / manifest_every_writes, 8)`` entries per write, whatever the
        number of writes."""
        with self._mlock:
            self._manifest[chunk_id] = header
            self._manifest.move_to_end(chunk_id)
            while len(self._manifest) > self.config.manifest_max_entries:
                self._manifest.popitem(last=False)
            self._manifest_changes += 1
            every = self.config.manifest_every_writes
            due = max(every, len(self._manifest) // 8)
            flush = every > 0 and self._manifest_changes >= due and not self._closing
        if flush:
            self.flush_manifest(blocking=False)

    def take_own_objects(self) -> frozenset[str]:
        """The listed objects this writer id's manifest named at the last scan without
        ``collect``, once.

        That is the start-up scan. They were written by this host, rank and namespace
        before a restart: ours to reclaim. The set is then dropped: up to
        ``manifest_max_entries`` ids need not stay in memory."""
        return self._scanner.take_own_objects()

    def manifest_entries(self) -> int:
        """Entries this writer's manifest holds now (at most ``manifest_max_entries``)."""
        with self._mlock:
            return len(self._manifest)

    def header_cache_entries(self) -> int:
        """Headers kept from earlier scans (at most ``header_cache_entries``)."""
        return self._scanner.header_cache_entries()

    def header_cache_bytes(self) -> int:
        """Memory the headers kept from earlier scans hold (at most ``header_cache_bytes``,
        as :func:`~vllm_kvtier.chunkformat.header_memory_bytes` counts it)."""
        return self._scanner.header_cache_bytes()

    def stats(self) -> S3Stats:
        """Requests (every HTTP attempt), retries, failed jobs by reason, the breaker."""
        requests, retries = self.medium.request_counts()
        failures = {str(r): n for r, n in self.op_stats().failures.items()}
        return S3Stats(requests, retries, failures, self.breaker.snapshot())

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued uploads and loads (up to ``timeout_s``), stop the threads, write
        this writer's manifest. Idempotent."""
        with self._mlock:
            first, self._closing = not self._closing, True
        self.kernel.close(timeout_s)
        if first and self._manifest_changes:
            self.flush_manifest()

    # ---- manifest -------------------------------------------------------------------------

    def flush_manifest(self, *, blocking: bool = True) -> bool:
        """Write this writer's manifest now (blocks for one PUT). False if it failed, or if
        another flush is running and ``blocking`` is False."""
        if not self._flush_lock.acquire(blocking=blocking):
            return False
        try:
            if not self._adopted:
                self._adopt_predecessor()
            with self._mlock:
                entries = list(self._manifest.items())
                changes = self._manifest_changes
            body = encode_manifest(self.namespace, entries)
            if self.auth is not None:  # signed: bound to this namespace, rank and writer id
                body = sign_manifest(body, self.auth.key_id,
                                     self.auth.manifest_mac(self.namespace, self.rank, self.writer_id, body))
            self.medium.put_key(self.manifest_key(), body, self.medium.soon())
            with self._mlock:
                self._manifest_changes -= changes
            if self._legacy_manifest is not None:  # ours, proved by its signature: the new name replaces it
                self._scanner.delete_quietly(self._legacy_manifest)
                self._legacy_manifest = None
            return True
        except Exception as e:
            logger.warning("kvtier s3: manifest write failed (%s): %s", error_reason(e), e)
            return False
        finally:
            self._flush_lock.release()

    def _adopt_predecessor(self) -> None:
        """Merge the manifest this writer id left before a restart (one GET, once).

        So the next one still covers those objects. This process's writes stay the newest.
        A failed GET is a lost cache, never an error.

        With a key and no manifest under the tagged name, the untagged name is read too
        (one more GET, once). Older builds used that name. If its signature verifies for
        this writer id, it is merged, and deleted after the next manifest write."""
        old: dict[str, ChunkHeader] = {}
        keys = [self.manifest_key()]
        if self.auth is not None:  # and the name an earlier build used
            keys.append(f"{self.medium.prefix}manifest/{self.writer_id}{MANIFEST_SUFFIX}")
        for i, key in enumerate(keys):
            try:  # ours, but the bucket is shared: verified
                old = self._scanner.read_manifest(key, None, writer_id=self.writer_id)
                self._legacy_manifest = key if i else None
                break
            except Exception as e:
                if error_reason(e) is not FailureReason.MISSING:
                    logger.info("kvtier s3: previous manifest of %s not merged: %s", self.writer_id, e)
                    break
        with self._mlock:
            self._adopted = True
            room = self.config.manifest_max_entries - len(self._manifest)
            keep = [(oid, h) for oid, h in old.items()
                    if oid not in self._manifest and oid not in self._deleted_before_adopt]
            merged = OrderedDict(keep[max(0, len(keep) - room):] if room > 0 else [])
            merged.update(self._manifest)
            self._manifest = merged
            self._deleted_before_adopt.clear()

    # ---- index rebuild (caller's thread; blocks) --------------------------------------------

    def scan(self, *, cleanup: bool = False, collect: bool = False, deadline: float | None = None) -> ScanResult:
        """Every verified chunk of this (namespace, rank) in the bucket, oldest first (by
        LastModified).

        It costs ``ceil(keys/1000)`` LISTs and one GET per manifest changed since the last
        scan (by its ETag). It costs one ranged GET per object that neither a manifest nor
        the header cache of earlier scans covers (see :attr:`last_scan`). Never raises for
        a failed request. What could not be read is left out and counted in ``problems``.
        A failed listing finds nothing (``list_<reason>``), and ``last_scan.complete`` is
        False.

        With ``cleanup`` (the worker that owns the prefix), objects that fail to verify are
        deleted. With ``cleanup`` or ``collect`` (a live instance's rescans), some
        manifests of other writers are deleted (``last_scan.manifests_collected``). Those
        are manifests not rewritten for ``manifest_max_age_s`` or covering no listed
        object.

        ``deadline`` (a ``time.monotonic()`` time; None: none): no LIST page, manifest GET
        or header GET starts after it. A scan cut short returns what it verified by then
        (``last_scan.cut_short``). ``complete`` is False if the listing itself was cut; then
        nothing is collected or cleaned up. Its header cache keeps what it read, so the
        next scan goes on from there."""
        return self._scanner.scan(cleanup=cleanup, collect=collect, deadline=deadline)

    def manifest_limit_bytes(self) -> int:
        """The largest manifest this store reads: ``manifest_max_entries`` entries of
        ``chunk_blocks``-block headers and a signature, at most
        :data:`~vllm_kvtier.tiers.s3.scan.MAX_MANIFEST_BYTES`."""
        return self._scanner.manifest_limit_bytes()
