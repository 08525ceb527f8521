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
holds what is S3's above the bytes: the key layout, manifests and the start-up listing,
and the request figures.

Modules: the byte primitives (PUT or multipart, ranged GET, DELETE, retries, the circuit
breaker, request counts) are in :mod:`~vllm_kvtier.tiers.s3.medium`. Configuration, key
layout and the failure classifier are in :mod:`~vllm_kvtier.tiers.s3.config`. Request bodies are in
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
(``.../r<rank>/manifest/<writer_id>.kvm``). It holds the headers of the writer's latest
``manifest_max_entries`` writes. The writer id is stable across restarts: a digest of host
name, rank and namespace, or ``s3.writer_id``. So a restarted writer merges and replaces
its predecessor's manifest instead of adding one. The manifest is rewritten after
``manifest_every_writes`` writes, or after an eighth of its entries once that is more. So
the bytes uploaded per write stay bounded. It is rewritten at close too.

Index: :meth:`S3Store.scan` lists the rank's prefix (one LIST request per 1,000 keys) and
needs each object's header. A scan costs ``ceil(keys / 1000)`` LISTs + one GET per manifest whose ETag changed since this store's
last scan + one ranged GET (first 4 KiB) per object that neither a manifest nor the store's
header cache of earlier scans (``header_cache_entries``, LRU, listed objects only) covers.
The listing is the truth; a manifest entry is used only for an object the listing shows,
so a stale or lost manifest costs requests, never correctness. A live instance's rescans
(``collect``) delete other writers' manifests not rewritten for ``manifest_max_age_s`` or
covering no listed object. Every size in a listed header or a manifest is bounded by what
this engine could have written (``max_chunk_blocks`` blocks of ``block_bytes``) before it
sizes anything. A manifest is unsigned input: one longer than ``manifest_max_entries``
entries can need is refused by its ContentLength, and it is decoded as its body arrives,
only the entries of listed objects kept (:meth:`S3Store.manifest_limit_bytes`,
:func:`~vllm_kvtier.tiers.s3.manifest.iter_manifest`). The start-up scan has an overall
deadline (``scan(deadline=)``, ``s3.scan_deadline_s``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from vllm_kvtier.chunkformat import (
    FIXED_BYTES,
    MAX_CHUNK_BLOCKS,
    ChunkFormatError,
    ChunkHeader,
    bounded_header_bytes,
    decode_header,
    header_memory_bytes,
    max_chunk_bytes,
)
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.base import ScanResult
from vllm_kvtier.tiers.buffers import BufferPool, shared_pool
from vllm_kvtier.tiers.kernel import StoreKernel
from vllm_kvtier.tiers.resilience import (
    CircuitBreaker,
    DeadlineExceeded,
    RemoteStats,
)
from vllm_kvtier.tiers.s3.config import (
    HEAD_PROBE_BYTES,
    MANIFEST_SUFFIX,
    SUFFIX,
    S3Config,
    error_reason,
    is_transient,
    object_key,
    rank_prefix,
)
from vllm_kvtier.tiers.s3.manifest import (
    SIG_BYTES,
    encode_manifest,
    iter_manifest,
    max_manifest_bytes,
    sign_manifest,
    signed_body,
)
from vllm_kvtier.tiers.s3.medium import S3Medium
from vllm_kvtier.tiers.s3.object_io import read_body_into

if TYPE_CHECKING:
    from vllm_kvtier.config.sections import S3TierConfig
    from vllm_kvtier.tiers.registry import StoreContext

__all__ = [
    "MAX_MANIFEST_BYTES",
    "S3Config",
    "S3Medium",
    "S3Stats",
    "S3Store",
    "ScanReport",
    "default_writer_id",
    "error_reason",
    "is_transient",
    "object_key",
    "rank_prefix",
    "read_body_into",
]

logger = logging.getLogger(__name__)

#: Why an object's own header was refused that the same bytes will always give: remembered
#: (by listed size) so that a rescan does not fetch it again.
_STABLE_REFUSALS = frozenset({FailureReason.UNAUTHENTICATED, FailureReason.AUTH_FAILED, FailureReason.KEY_MISMATCH,
                              FailureReason.FORMAT, FailureReason.NAMESPACE, FailureReason.TOO_LARGE})

#: The S3 store's figures (the shape every remote store reports).
S3Stats = RemoteStats

#: The largest manifest object a scan reads, whatever the config: a store refuses one
#: above :meth:`S3Store.manifest_limit_bytes` (what ``manifest_max_entries`` entries of
#: ``chunk_blocks`` blocks can need), and this, by its ``ContentLength`` before reading it.
#: A manifest is decoded as it arrives (:func:`~vllm_kvtier.tiers.s3.manifest.iter_manifest`,
#: which bounds its own fields), so its size costs transfer, not memory.
MAX_MANIFEST_BYTES = 1 << 30
def default_writer_id(namespace: str, rank: int) -> str:
    """A writer id stable across restarts: a digest of the host name (a pod's name in
    Kubernetes), the rank and the namespace. Two instances of one model and rank on one
    host name share it: they then overwrite each other's manifest (costing header GETs,
    never correctness) unless ``s3.writer_id`` tells them apart."""
    return hashlib.sha256(f"{socket.gethostname()}|{rank}|{namespace}".encode()).hexdigest()[:16]


# ---- the store ----------------------------------------------------------------------------


@dataclass
class _Listing:
    #: object_id -> (size, LastModified as a timestamp, key)
    objects: dict[str, tuple[int, float, str]] = field(default_factory=dict)
    #: manifest key -> (ETag, LastModified as a timestamp)
    manifests: dict[str, tuple[str, float]] = field(default_factory=dict)
    requests: int = 0
    #: the scan's deadline passed before the last page
    cut: bool = False


@dataclass(frozen=True)
class ScanReport:
    """What the last :meth:`S3Store.scan` found and what it cost in requests."""

    objects: int = 0
    list_requests: int = 0
    manifest_gets: int = 0
    header_gets: int = 0
    #: objects whose header came from a manifest (no GET needed)
    from_manifests: int = 0
    #: problem -> count (unverifiable objects or manifests, a failed listing...)
    problems: dict[str, int] = field(default_factory=dict)
    #: objects whose header came from this store's cache of earlier scans (no GET)
    from_cache: int = 0
    #: manifests not fetched because their ETag had not changed since the last scan
    manifests_unchanged: int = 0
    #: manifests deleted: not rewritten for ``manifest_max_age_s``, or covering no object
    manifests_collected: int = 0
    #: False when the listing failed or was cut short: ``found`` is then not what the bucket holds
    complete: bool = True
    #: the scan's ``deadline`` passed: the listing, manifests or header GETs not done by
    #: then were skipped (``problems["deadline"]`` counts the objects left out)
    cut_short: bool = False


class S3Store(StoreKernel):
    """The S3 tier's :class:`~vllm_kvtier.tiers.base.ChunkStore` for one (namespace, rank):
    the kernel over :class:`S3Medium`, also :class:`~vllm_kvtier.tiers.base.Scannable` and
    :class:`~vllm_kvtier.tiers.base.ReportsRemoteStats`. See the module doc."""

    medium: S3Medium

    def __init__(self, config: S3Config, namespace: str, rank: int, block_bytes: int, *,
                 buffers: BufferPool | None = None, max_chunk_blocks: int = MAX_CHUNK_BLOCKS,
                 read_deadline_s: float | None = None, auth: ChunkAuth | None = None) -> None:
        """Builds the client (ImportError with the install hint without boto3; ConfigError
        naming ``s3.io_engine`` if it cannot run here) and starts the threads; sends no
        request. ``buffers``: the worker's read-buffer pool (None: the process default);
        ``max_chunk_blocks``: the config's ``chunk_blocks`` (the bound of a stored block
        count); ``read_deadline_s``: None is ``s3.deadline_s``."""
        medium = S3Medium(config, namespace, rank)
        self.config = config
        self.rank = rank
        self.writer_id = config.writer_id or default_writer_id(namespace, rank)
        self.last_scan = ScanReport()
        self._mlock = threading.Lock()
        #: this writer's latest objects, oldest first (at most ``manifest_max_entries``)
        self._manifest: OrderedDict[str, ChunkHeader] = OrderedDict()
        self._manifest_changes = 0
        #: the predecessor's manifest (same writer id, before a restart) merged in yet?
        self._adopted = False
        self._deleted_before_adopt: set[str] = set()
        #: scans: object id -> (listed size, verified header, its memory) of earlier scans,
        #: LRU (at most ``header_cache_entries`` and ``header_cache_bytes`` of headers;
        #: only objects the last listing showed)
        self._headers: OrderedDict[str, tuple[int, ChunkHeader, int]] = OrderedDict()
        self._headers_bytes = 0
        self._headers_overflowed = False  # the last scan's headers did not all fit
        #: scans: object id -> (listed size, why) of objects whose own header a read would
        #: refuse (a key not accepted, another rank, an old format version): not fetched
        #: again while listed at that size (LRU, at most ``header_cache_entries``)
        self._refused: OrderedDict[str, tuple[int, FailureReason]] = OrderedDict()
        #: scans: manifest key -> ETag when last read (only manifests the last listing showed)
        self._manifest_etags: dict[str, str] = {}
        #: listed objects that this writer id's manifest names, see :meth:`take_own_objects`
        self._own_objects: frozenset[str] = frozenset()
        self._flush_lock = threading.Lock()
        self._closing = False
        super().__init__(medium, namespace=namespace, block_bytes=block_bytes, max_chunk_blocks=max_chunk_blocks,
                         buffers=buffers or shared_pool(),
                         read_deadline_s=config.deadline_s if read_deadline_s is None else read_deadline_s,
                         write_deadline_s=config.deadline_s, io_threads=config.io_threads,
                         write_threads=config.io_threads, max_queued_writes=config.max_queued_writes, auth=auth,
                         rank=rank)

    @classmethod
    def from_config(cls, section: S3TierConfig, ctx: StoreContext) -> S3Store:
        """The registry's constructor (:mod:`~vllm_kvtier.tiers.registry`): ``section``
        is ``cfg.s3``. With ``ctx.lookup_only`` (the scheduler, which only lists and
        reads headers, always through boto3) no NIXL agent is made, whatever
        ``s3.io_engine`` says: the workers check that it runs."""
        config = replace(section.store, io_engine="boto3") if ctx.lookup_only else section.store
        return cls(config, ctx.namespace, ctx.rank, ctx.block_bytes, buffers=ctx.buffers,
                   max_chunk_blocks=section.chunk_blocks, auth=ctx.auth)

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

    # ---- keys ---------------------------------------------------------------------------

    def key(self, object_id: str) -> str:
        return self.medium.key(object_id)

    def manifest_key(self, writer_id: str | None = None) -> str:
        return f"{self.medium.prefix}manifest/{writer_id or self.writer_id}{MANIFEST_SUFFIX}"

    # ---- the contract, where S3 adds to the kernel ------------------------------------------

    def forget(self, chunk_ids: list[str]) -> None:
        """Chunks a rescan no longer lists (lifecycle expiry, an out-of-band delete) leave
        this writer's manifest (:class:`~vllm_kvtier.tiers.base.Forgets`): it holds only
        objects that were still there at the last listing, not ghosts until the entry cap
        pushes them out. Ids of other writers' chunks are not in it. No request is sent;
        the next manifest rewrite carries the change."""
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
        super().submit_delete(chunk_id)

    def on_written(self, chunk_id: str, header: ChunkHeader) -> None:
        """Into this writer's manifest (its latest ``manifest_max_entries`` writes; the
        oldest entry leaves). It is rewritten (here, on the write thread; skipped if a
        flush is running) after ``manifest_every_writes`` changes, or after an eighth of
        its entries once that is more: the bytes uploaded stay at most
        ``max(entries / manifest_every_writes, 8)`` entries per write, whatever the
        number of writes, instead of growing with it."""
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
        ``collect`` (the start-up scan; written by this host, rank and namespace before a
        restart: ours to reclaim), once: the set is dropped (up to ``manifest_max_entries``
        ids need not stay in memory)."""
        out, self._own_objects = self._own_objects, frozenset()
        return out

    def manifest_entries(self) -> int:
        """Entries this writer's manifest holds now (at most ``manifest_max_entries``)."""
        with self._mlock:
            return len(self._manifest)

    def header_cache_entries(self) -> int:
        """Headers kept from earlier scans (at most ``header_cache_entries``)."""
        return len(self._headers)

    def header_cache_bytes(self) -> int:
        """Memory the headers kept from earlier scans hold (at most ``header_cache_bytes``,
        as :func:`~vllm_kvtier.chunkformat.header_memory_bytes` counts it)."""
        return self._headers_bytes

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
        super().close(timeout_s)
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
            return True
        except Exception as e:
            logger.warning("kvtier s3: manifest write failed (%s): %s", error_reason(e), e)
            return False
        finally:
            self._flush_lock.release()

    def _adopt_predecessor(self) -> None:
        """Merge the manifest this writer id left before a restart (one GET, once), so the
        next one still covers those objects; this process's writes stay the newest. A
        failed GET is a lost cache, never an error."""
        try:
            old = self._read_manifest(self.manifest_key(), None)  # ours, but the bucket is shared: verified
        except Exception as e:
            if error_reason(e) is not FailureReason.MISSING:
                logger.info("kvtier s3: previous manifest of %s not merged: %s", self.writer_id, e)
            old = {}
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
        LastModified). Costs ``ceil(keys/1000)`` LISTs, one GET per manifest changed since
        the last scan (by its ETag) and one ranged GET per object neither a manifest nor
        the header cache of earlier scans covers (see :attr:`last_scan`). Never raises for
        a failed request: what could not be read is left out and counted in ``problems``
        (a failed listing finds nothing, ``list_<reason>``, and ``last_scan.complete`` is
        False).

        With ``cleanup`` (the worker that owns the prefix), objects that fail to verify are
        deleted. With ``cleanup`` or ``collect`` (a live instance's rescans), manifests of
        other writers not rewritten for ``manifest_max_age_s`` or covering no listed
        object are deleted (``last_scan.manifests_collected``).

        ``deadline`` (a ``time.monotonic()`` time; None: none): no LIST page, manifest GET
        or header GET starts after it. A scan cut short returns what it verified by then
        (``last_scan.cut_short``; ``complete`` False if the listing itself was cut, and then
        nothing is collected or cleaned up); its header cache keeps what it read, so the
        next scan goes on from there."""
        problems: dict[str, int] = {}
        late = (lambda: False) if deadline is None else (lambda: time.monotonic() >= deadline)

        def problem(what: str) -> None:
            problems[what] = problems.get(what, 0) + 1

        listing = _Listing()
        try:
            self._list_rank(listing, problem, late)
        except Exception as e:
            problem(f"list_{error_reason(e)}")
            logger.warning("kvtier s3: listing %s failed: %s", self.medium.prefix, e)
            self.last_scan = ScanReport(0, listing.requests, 0, 0, 0, problems, complete=False)
            return ScanResult({}, problems)
        if listing.cut:
            problem("list_deadline")
            cleanup = collect = False  # a partial listing: what it does not show may exist
        objects = listing.objects
        found: dict[str, ChunkHeader] = {}
        doomed: list[str] = []
        from_cache = 0
        with ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvtier-s3-scan") as pool:
            # An unchanged manifest's entries are in the header cache, unless it overflowed.
            full = self._headers_overflowed
            fresh = [m for m, (etag, _) in listing.manifests.items()
                     if full or self._manifest_etags.get(m) != etag]
            covered = self._manifest_headers(pool, listing, fresh, cleanup or collect, problem, doomed, late)
            todo = []
            for oid, (size, _, key) in objects.items():
                cached = self._headers.get(oid)
                hit = cached is not None and cached[0] == size
                h = cached[1] if cached is not None and hit else covered.get(oid)
                refused = self._refused.get(oid)
                if refused is not None and refused[0] == size and h is None:
                    problem(refused[1])  # its own header was refused before: not fetched again
                    continue
                # A cached header was checked when it was first found; a manifest's entry is
                # checked here (one HMAC over the header), and if refused the object's own
                # header decides (a manifest entry never hides a good object).
                if (h is not None and h.block_bytes == self.block_bytes and size >= h.total_bytes
                        and (hit or self.refuses(oid, h) is None)):
                    found[oid] = h
                    from_cache += hit
                else:
                    todo.append((oid, size, key))
            probe = functools.partial(self._scan_header, late=late)
            for (oid, size, key), got in zip(todo, pool.map(probe, todo), strict=True):
                if isinstance(got, ChunkHeader):
                    found[oid] = got
                    continue
                problem(got)
                if got in _STABLE_REFUSALS:
                    self._refused[oid] = (size, got)
                    self._refused.move_to_end(oid)
                if cleanup and got.damaged and got is not FailureReason.MISSING:
                    doomed.append(key)
            list(pool.map(self._delete_quietly, doomed))
        self._remember(found, objects, listing)
        from_manifests = len(found) - from_cache - sum(1 for oid, _, _ in todo if oid in found)
        cut = listing.cut or late()
        self.last_scan = ScanReport(len(found), listing.requests, len(fresh), len(todo), from_manifests, problems,
                                    from_cache=from_cache, manifests_unchanged=len(listing.manifests) - len(fresh),
                                    manifests_collected=sum(1 for k in doomed if k.endswith(MANIFEST_SUFFIX)),
                                    complete=not listing.cut, cut_short=cut)
        return ScanResult({oid: found[oid] for oid in sorted(found, key=lambda oid: objects[oid][1])}, problems)

    def _remember(self, found: dict[str, ChunkHeader], objects: dict[str, tuple[int, float, str]],
                  listing: _Listing) -> None:
        """Keep the headers of this scan for the next one (LRU, bounded), and the ETags of
        the manifests it read; forget what the listing no longer shows."""
        cache = self._headers
        for oid in [o for o in cache if o not in objects]:
            self._headers_bytes -= cache.pop(oid)[2]
        refused = self._refused
        for oid in [o for o in refused if o not in objects or o in found]:
            del refused[oid]
        while len(refused) > self.config.header_cache_entries:
            refused.popitem(last=False)
        for oid, h in found.items():
            old = cache.get(oid)
            cost = old[2] if old is not None and old[1] is h else header_memory_bytes(h)
            self._headers_bytes += cost - (old[2] if old is not None else 0)
            cache[oid] = (objects[oid][0], h, cost)
            cache.move_to_end(oid)
        self._headers_overflowed = False
        while cache and (len(cache) > self.config.header_cache_entries
                         or self._headers_bytes > self.config.header_cache_bytes):
            self._headers_bytes -= cache.popitem(last=False)[1][2]
            self._headers_overflowed = True
        self._manifest_etags = {m: e for m, e in self._manifest_etags.items() if m in listing.manifests}

    def _list_rank(self, out: _Listing, problem: Callable[[str], None], late: Callable[[], bool]) -> None:
        """LIST the rank's prefix, sorting keys into chunks and manifests; no page asked
        for once ``late()`` (``out.cut``)."""
        root = self.medium.prefix
        for page in self.medium.list_pages():
            out.requests += 1
            for o in page.get("Contents", []):
                key, rel = o["Key"], o["Key"][len(root) :]
                oid = rel.rsplit("/", 1)[-1][: -len(SUFFIX)]
                if rel.startswith("manifest/") and rel.endswith(MANIFEST_SUFFIX):
                    out.manifests[key] = (str(o.get("ETag", "")), o["LastModified"].timestamp())
                elif rel.endswith(SUFFIX) and key == self.key(oid):
                    out.objects[oid] = (o["Size"], o["LastModified"].timestamp(), key)
                else:
                    problem("unknown_key")
            if page.get("IsTruncated") and late():
                out.cut = True
                return

    def _manifest_headers(self, pool: ThreadPoolExecutor, listing: _Listing, fresh: list[str], collect: bool,
                          problem: Callable[[str], None], doomed: list[str],
                          late: Callable[[], bool]) -> dict[str, ChunkHeader]:
        """Headers from the manifests in ``fresh`` (changed since the last scan), for the
        objects the listing shows; with ``collect``, other writers' manifests that are
        stale (not rewritten for ``manifest_max_age_s``) or cover nothing go to ``doomed``."""
        covered: dict[str, ChunkHeader] = {}
        own = self.manifest_key()
        too_old = time.time() - self.config.manifest_max_age_s
        read = functools.partial(self._scan_manifest, keep=listing.objects, late=late)
        for mkey, got in zip(fresh, pool.map(read, fresh), strict=True):
            if isinstance(got, FailureReason):
                problem(f"manifest_{got}")
                continue
            self._manifest_etags[mkey] = listing.manifests[mkey][0]
            live = got  # listed objects only
            if mkey == own and not collect:  # the start-up scan only: see take_own_objects
                self._own_objects = frozenset(live)
            if not live and collect and mkey != own:
                doomed.append(mkey)
            covered.update(live)
        if collect:
            doomed.extend(m for m, (_, modified) in listing.manifests.items()
                          if modified < too_old and m != own and m not in doomed)
        return covered

    def manifest_limit_bytes(self) -> int:
        """The largest manifest this store reads: ``manifest_max_entries`` entries of
        ``chunk_blocks``-block headers and a signature, at most :data:`MAX_MANIFEST_BYTES`."""
        return min(MAX_MANIFEST_BYTES,
                   max_manifest_bytes(self.config.manifest_max_entries, self.max_chunk_blocks) + SIG_BYTES)

    def _read_manifest(self, key: str, keep: Container[str] | None,
                       late: Callable[[], bool] = lambda: False) -> dict[str, ChunkHeader]:
        """The entries of manifest ``key`` whose object is in ``keep`` (None: all), read and
        decoded as the body arrives: the object's length is bounded before it is read, at
        most ``manifest_max_entries`` entries, and only kept entries become objects. Raises
        what the GET, :func:`~vllm_kvtier.tiers.s3.manifest.iter_manifest` or
        :func:`~vllm_kvtier.tiers.s3.manifest.signed_body` raise (and DeadlineExceeded once
        ``late()`` between two pieces); nothing is returned from a manifest that fails its
        CRC or, with a key, its signature (for this namespace, rank and the writer id its
        name says), both checked at the end."""

        def in_time(pieces: Iterator[memoryview]) -> Iterator[memoryview]:
            for piece in pieces:
                if late():
                    raise DeadlineExceeded(f"manifest {key}: the scan's deadline passed")
                yield piece

        writer = key.rsplit("/", 1)[-1].removesuffix(MANIFEST_SUFFIX)
        hashers = None if self.auth is None else self.auth.manifest_hashers(self.namespace, self.rank, writer)
        with self.medium.open_bounded(key, self.manifest_limit_bytes()) as pieces:
            return dict(iter_manifest(signed_body(in_time(pieces), hashers), self.namespace, max_blocks=self.max_chunk_blocks,
                                      max_entries=self.config.manifest_max_entries,
                                      block_bytes=self.block_bytes, keep=keep))

    def _scan_manifest(self, key: str, keep: Container[str],
                       late: Callable[[], bool]) -> dict[str, ChunkHeader] | FailureReason:
        if late():
            return FailureReason.DEADLINE
        try:
            return self._read_manifest(key, keep, late)
        except Exception as e:
            logger.warning("kvtier s3: ignoring manifest %s: %s", key, e)
            return error_reason(e)

    def _scan_header(self, item: tuple[str, int, str],
                     late: Callable[[], bool] = lambda: False) -> ChunkHeader | FailureReason:
        """The verified header of one listed object (one ranged GET, two for a header
        longer than 4 KiB), every size in it bounded (by what this store writes, and by
        the listed size) before it sizes a read; ``deadline`` without a request once ``late()``."""
        _, size, key = item
        if late():
            return FailureReason.DEADLINE
        deadline = self.medium.soon()
        try:
            if size < FIXED_BYTES:
                raise ChunkFormatError(f"truncated: an object of {size} B", FailureReason.TRUNCATED)
            limit = max_chunk_bytes(self.max_chunk_blocks, self.block_bytes)
            if size > limit:
                raise ChunkFormatError(f"too large: an object of {size} B, at most {limit}", FailureReason.TOO_LARGE)
            head = bytearray(min(size, HEAD_PROBE_BYTES))
            self.medium.get_range(key, 0, memoryview(head), deadline)
            need = bounded_header_bytes(head, max_blocks=self.max_chunk_blocks,
                                        block_bytes=self.block_bytes)
            if need > size:
                raise ChunkFormatError(f"truncated header: {size} of {need} bytes", FailureReason.TRUNCATED)
            if need > len(head):
                rest = bytearray(need - len(head))
                self.medium.get_range(key, len(head), memoryview(rest), deadline)
                head += rest
            h = decode_header(bytes(head[:need]), self.namespace, rank=self.rank)
            if size < h.total_bytes:
                raise ChunkFormatError(f"truncated: {size} of {h.total_bytes} bytes", FailureReason.TRUNCATED)
            why = self.refuses(item[0], h)
            if why is not None:  # what a read would refuse is never indexed (nor offered again)
                raise ChunkFormatError(f"not trusted: {why}", why)
            return h
        except Exception as e:
            logger.warning("kvtier s3: ignoring %s: %s", key, e)
            return error_reason(e)

    def _delete_quietly(self, key: str) -> None:
        try:
            self.medium.delete_key(key)
        except Exception as e:
            logger.warning("kvtier s3: delete of %s failed (%s): %s", key, error_reason(e), e)
