"""How the NVMe tier moves a chunk's bytes between host memory and an open file.

This is the ``nvme.io_engine`` plug point.

Who calls it: :class:`~vllm_kvtier.tiers.nvme.store.NVMeStore`'s I/O threads, several at once,
each call on its own file descriptor and buffer. A call blocks its thread until every byte
moved or the transfer failed. The store builds the engine once, at start-up. There a
missing library or plugin is a :class:`~vllm_kvtier.errors.ConfigError` naming
``nvme.io_engine``. The store closes it after its threads stopped.

Some things an engine does NOT do, so that they are the same code for every engine. Those
are: open the file (with O_DIRECT when the store's probe allows it), the temporary name
and the rename, ``fdatasync``, ``posix_fadvise``, the chunk header, and the CRC32 check of
every block before a read is trusted. Those stay in the store. The bytes on disk are
therefore the same whichever engine wrote them. A chunk written through one engine reads
through any other.

Engines (:data:`FILE_IO_ENGINES`, name -> import path, imported on first use):

* ``posix`` (default): ``pwrite``/``preadv`` loops in the calling thread.
* ``nixl``: NIXL's POSIX backend (Linux AIO), one transfer per call, split into
  :data:`~vllm_kvtier.tiers.nixl.io_engine.PIECE_BYTES` pieces so several are in flight.
* ``nixl-gds``: NIXL's GDS backend (cuFile); accepted only where that plugin loads (a CUDA
  host with libcufile). Our buffers are host memory, so it changes the I/O path, not where
  the bytes land.

Failure: ``write``/``read_into`` raise :class:`OSError`, with an errno as precise as the
engine can know. NIXL reports only "failed". So the NIXL engines say ENOSPC when the
filesystem is full and EIO otherwise. They may also raise
:class:`~vllm_kvtier.chunkformat.ChunkFormatError` ``truncated`` when the file ends
before the range. The store turns either into a failed result (a miss) and a counter.
"""

from __future__ import annotations

import importlib
import os
from typing import Protocol

from vllm_kvtier.chunkformat import ChunkFormatError
from vllm_kvtier.errors import ConfigError, FailureReason

__all__ = ["FILE_IO_ENGINES", "FileIO", "PosixFileIO", "make_file_io"]

#: ``nvme.io_engine`` value -> "module:factory"; the factory takes no argument.
FILE_IO_ENGINES: dict[str, str] = {
    "posix": "vllm_kvtier.tiers.nvme.file_io:PosixFileIO",
    "nixl": "vllm_kvtier.tiers.nixl.io_engine:NixlPosixFileIO",
    "nixl-gds": "vllm_kvtier.tiers.nixl.io_engine:NixlGdsFileIO",
}


class FileIO(Protocol):
    """Moves bytes between page-aligned host memory and an open file (see the module doc
    for who calls it and what it leaves to the store)."""

    #: the ``nvme.io_engine`` value
    name: str

    def write(self, fd: int, view: memoryview, offset: int) -> None:
        """Write all of ``view`` at ``offset``. Not durable yet: the store syncs."""
        ...

    def read_into(self, fd: int, view: memoryview, offset: int) -> None:
        """Fill all of ``view`` from ``offset``; ChunkFormatError ``truncated`` if the file
        ends first. After a failure the bytes in ``view`` are undefined."""
        ...

    def close(self) -> None:
        """Free the engine's resources; called once, after the last transfer."""
        ...


class PosixFileIO:
    """``pwrite``/``preadv`` in the calling thread (the GIL is released during each call)."""

    name = "posix"

    def write(self, fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < view.nbytes:
            with view[done:] as rest:
                done += os.pwrite(fd, rest, offset + done)

    def read_into(self, fd: int, view: memoryview, offset: int) -> None:
        got = 0
        while got < view.nbytes:
            with view[got:] as rest:
                n = os.preadv(fd, [rest], offset + got)
            if n == 0:
                raise ChunkFormatError(f"truncated: read {got} of {view.nbytes} bytes", FailureReason.TRUNCATED)
            got += n

    def close(self) -> None:
        pass


def make_file_io(name: str) -> FileIO:
    """The engine called ``name``. ConfigError naming ``nvme.io_engine``: an unknown name, a
    library that is not installed (with the install hint), a NIXL plugin that does not load."""
    target = FILE_IO_ENGINES.get(name)
    if target is None:
        raise ConfigError("nvme.io_engine", f"must be one of {', '.join(map(repr, FILE_IO_ENGINES))}, got {name!r}")
    module, _, factory = target.partition(":")
    engine: FileIO = getattr(importlib.import_module(module), factory)()
    return engine
