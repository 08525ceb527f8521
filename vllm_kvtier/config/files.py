"""Bounded reads of the files an operator names: configs, presets, key and secret files,
model configs, alert rules, traces, benchmark results.

Each read has a size limit, checked before reading and again while reading (a file may
grow). A path that is not a regular file (``/dev/zero``, a FIFO, a directory) is refused
at once: a FIFO is opened without waiting for a writer. So a wrong path gives a one-line
error naming the file, never a hang or an out-of-memory kill.

Errors are ValueError with a message that names the file; callers add the field or option.
Called from any thread; each call blocks only on the read itself.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

#: Config and model files are a few KiB; anything beyond this is not one (``/dev/zero``).
MAX_CONFIG_FILE_BYTES = 4 << 20


def size_text(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it, e.g. ``4 MiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _too_big(path: Path, max_bytes: int) -> ValueError:
    return ValueError(f"{path} is larger than the {size_text(max_bytes)} limit for this file")


def open_regular(path: str | Path, max_bytes: int) -> BinaryIO:
    """``path`` opened for reading in binary. ValueError saying why not: it cannot be
    opened, it is not a regular file, or it is already larger than ``max_bytes``."""
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot read {p}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{p} is not a regular file")
        if st.st_size > max_bytes:  # a sparse file is refused without reading it
            raise _too_big(p, max_bytes)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_small_file(path: str | Path, max_bytes: int = MAX_CONFIG_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``. ValueError saying why
    not (missing, a device or FIFO, too big, not UTF-8): callers name the field."""
    p = Path(path)
    with open_regular(p, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_big(p, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text: {e}") from None


def read_lines(path: str | Path, max_bytes: int, max_line_bytes: int) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of a UTF-8 file, read one line at a time: the
    file at most ``max_bytes``, each line at most ``max_line_bytes``. ValueError naming the
    file (and the line, for a line too long or not UTF-8)."""
    p = Path(path)
    total = 0
    with open_regular(p, max_bytes) as f:
        for n in range(1, 1 << 62):
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            total += len(raw)
            if total > max_bytes:
                raise _too_big(p, max_bytes)
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise ValueError(f"{p}:{n}: line longer than the {size_text(max_line_bytes)} limit")
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{p}:{n}: not UTF-8 text: {e.reason}") from None
