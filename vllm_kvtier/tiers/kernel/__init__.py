"""ONE store kernel: the :class:`~vllm_kvtier.tiers.base.ChunkStore` contract implemented
once, over a medium that only moves bytes (:class:`Medium`).

What the kernel owns, for every medium:

* The bounded write queue with back-pressure. ``submit_write`` is False when
  ``max_queued_writes`` wait; the caller keeps its buffer.
* A write buffer's deferred ``fill`` (the caller's copy into it). It runs on the I/O thread
  before the header is stamped. A fill that finds its source changed ends the write
  ``superseded``, with nothing written.
* Reads served before writes, by one priority queue. With ``write_threads``, writes get
  threads of their own, so a long upload never holds a read back.
* Read deadlines. :meth:`StoreKernel.poll` fails a read not answered within
  ``read_deadline_s`` of its submission (``deadline``), whatever the medium. The late
  answer is dropped and its buffer freed. There is exactly one result per job: the
  thread's or the deadline's, whoever claims the job first.
* The completion queue, the wait event and per-operation stats.
* Header stamping on write: every block's CRC32, keys, namespace, the store's rank
  (``encode_header``). With a key (``auth``, :mod:`~vllm_kvtier.tiers.auth`), it writes the
  authenticated format. Every block gets a tag, bound to the namespace, rank and block key.
  The header gets a MAC, bound to the chunk id.
* The ONE verified read path:

  * Every size read from stored bytes is bounded BEFORE memory is sized from it
    (``too_large``/``format``). The bound is what this engine could have written:
    ``max_chunk_blocks`` blocks of ``block_bytes``
    (:func:`~vllm_kvtier.chunkformat.bounded_header_bytes`, :func:`max_chunk_bytes`).
  * The key at each read position must be the key asked for (``key_mismatch``).
  * A stored header read along must be the caller's (``checksum``).
  * The CRC32 of every block is checked before a result is made.
  * With a key, every header (the caller's, or one read) must carry a valid MAC. It must
    verify under one of this store's accepted keys for this chunk id. Every wanted block
    must carry its tag. Both are checked before a result is made.
  * ``auth_failed``: signed with an accepted key id but not verifying.
  * ``unauthenticated``: unsigned, signed with a key not accepted, or signed while this
    store holds no key.
  * Unsigned chunks are served only by a store without a key. Signed ones are served only
    by a store that accepts their key.
  * With or without a key, a header must be of this store's rank (``key_mismatch``).
    Every TP/PP rank stores its shard of a chunk under the same id. Only the medium's path
    (not signed) tells them apart.

The parts: the engine (:mod:`.engine`: :class:`StoreKernel`, queues, threads, poll, wait,
close), the verified read path (:mod:`.reads`), the write stamping (:mod:`.stamping`), the
shared state and settings (:mod:`.core`) and the jobs and queue items (:mod:`.jobs`). A
store holds a kernel and its medium (:mod:`.store`: :class:`KernelStore`). The medium
protocols are :mod:`vllm_kvtier.tiers.medium`.

What a medium implements (:class:`~vllm_kvtier.tiers.medium.Medium`):

* ``put`` (atomic).
* ``read_into`` (exactly the bytes asked for, or raise).
* ``delete``.
* ``classify``: maps its exceptions to :class:`~vllm_kvtier.errors.FailureReason`. It goes
  by type and code, never by message text.
* ``read_shape``: how a read of some positions becomes byte ranges.

Optional abilities:

* :class:`SizedMedium` (``size_of``): the medium reads whole objects and can tell their
  size first.
* :class:`AllocatingMedium` (``take_buffer``): reads land in the medium's own registered
  memory.
* :class:`BatchingMedium` (``put_batch``/``read_batch``): the kernel hands it every queued
  operation of one kind at once, up to ``max_batch``.

Non-regular files, holes and leftovers are the medium's to refuse in its primitives (NVMe:
``not_regular``, ``truncated``).

How the media map onto it:

* **memory** (:mod:`~vllm_kvtier.tiers.memory`): a dict of bytearrays; ``read_shape``
  "span"; the reference implementation.
* **NVMe** (:mod:`~vllm_kvtier.tiers.nvme.store`): one file per chunk. ``put`` = tmp file +
  fdatasync + rename. ``read_into`` = open (O_NONBLOCK, refuses non-regular files; O_DIRECT
  when probed), a hole check (SEEK_HOLE), then the ``nvme.io_engine``'s read.
  ``read_shape`` is "span": one aligned range from the first to the last wanted block, so
  one I/O. O_DIRECT needs page-aligned offsets, lengths and buffers, which the kernel
  keeps. Start-up scan (:class:`~vllm_kvtier.tiers.base.Scannable`) is the store's, not the
  kernel's.
* **S3** (to port): ``put`` = PUT or multipart. Retries, breaker and the write deadline are
  inside the medium. ``read_into`` = one ranged GET through ``s3.io_engine``, with retries
  bounded by the deadline it is given. ``read_shape`` is "runs": one ranged GET per
  contiguous run of wanted blocks. Each is queued as its own task, so the runs of one read
  go in parallel on the read threads. ``write_threads`` = io_threads keeps uploads off
  them. A read with no header (another writer's chunk) probes the first 4 KiB through
  ``read_into``. The kernel bounds the announced header before fetching the rest. A read of
  every block is one plain GET of the whole object (:class:`WholeObjectMedium`).
  ``Scannable`` (listing + manifests, with :func:`~vllm_kvtier.tiers.s3.manifest.decode_manifest`'s
  bounds) and ``ReportsRemoteStats`` stay on the S3 store.
* **Mooncake** (:mod:`~vllm_kvtier.tiers.mooncake.medium`): ``SizedMedium.size_of`` =
  ``get_size`` from the master. The kernel bounds it by :func:`max_chunk_bytes` before it
  takes memory. ``AllocatingMedium.take_buffer`` = a slice of the registered arena (None:
  ``no_buffer``). ``BatchingMedium.read_batch`` = ``batch_get_into`` of whole objects.
  ``put_batch`` = copy into the arena + ``batch_put_from``. ``read_shape`` is "whole". A
  read with no header is then one ``size_of`` and the whole object as the read's one range.
  It is batched with the other reads. Its header is decoded, bounded and checked when it
  lands. ``Probeable.exists``, ``ReportsRemoteStats``, the breaker and a close that goes on
  in the background stay on the Mooncake store.
"""

from vllm_kvtier.tiers.kernel.core import KernelSettings, OnWritten
from vllm_kvtier.tiers.kernel.engine import StoreKernel
from vllm_kvtier.tiers.kernel.jobs import KernelStats
from vllm_kvtier.tiers.kernel.store import KernelStore
from vllm_kvtier.tiers.medium import (
    AllocatingMedium,
    BatchingMedium,
    ExplainingMedium,
    Medium,
    ReadShape,
    SizedMedium,
    WholeObjectMedium,
)

__all__ = [
    "AllocatingMedium", "BatchingMedium", "ExplainingMedium", "KernelSettings", "KernelStats", "KernelStore",
    "Medium", "OnWritten", "ReadShape", "SizedMedium", "StoreKernel", "WholeObjectMedium",
]
