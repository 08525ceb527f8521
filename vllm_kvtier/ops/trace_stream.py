"""A trace read from its file at each pass, for replays whose memory must not grow with
the trace (``kvtier plan --trace``).

Who calls it: the CLI thread. :func:`open_trace` reads the file once to check every
record, find the block size and count the requests; each :meth:`TraceFile.requests`
reads it again, one line at a time. So a replay holds one request at a time plus the
tiers' indexes. A file whose timestamps go backwards cannot be replayed in order
without sorting it: :func:`open_trace` then reads it whole (:func:`read_trace`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vllm_kvtier.config.files import read_lines
from vllm_kvtier.ops.trace_sim import (
    _BLOCK_CANDIDATES,
    DEFAULT_TOKEN_BLOCK,
    MAX_TRACE_BYTES,
    MAX_TRACE_LINE_BYTES,
    Trace,
    TraceError,
    TraceRequest,
    _check_record,
    _parse_line,
    hash_ids_from_tokens,
    key_of,
    read_trace,
)


def _records(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, checked record) of each non-blank line; TraceError naming the line."""
    try:
        for n, line in read_lines(path, MAX_TRACE_BYTES, MAX_TRACE_LINE_BYTES):
            if line.strip():
                where = f"{path}:{n}"
                yield where, _check_record(_parse_line(line, where), where)
    except ValueError as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError("", str(e)) from None


@dataclass(frozen=True)
class TraceFile:
    """A trace file sorted by timestamp, read again at each pass (module doc). The same
    reading interface as :class:`~vllm_kvtier.ops.trace_sim.Trace`."""

    path: Path
    block_tokens: int
    block_tokens_source: str
    count: int
    prompt_tokens: int
    duration_s: float

    def __len__(self) -> int:
        return self.count

    def requests(self) -> Iterator[TraceRequest]:
        for _, r in _records(self.path):
            ids = r.get("hash_ids")
            if ids is None:
                ids = hash_ids_from_tokens(r["prompt_token_ids"], self.block_tokens)
            yield TraceRequest(int(r["timestamp"]), int(r["input_length"]), int(r["output_length"]),
                               tuple(key_of(h) for h in ids))


def open_trace(path: str | Path, block_tokens: int | None = None) -> TraceFile | Trace:
    """The trace at ``path`` for streamed replays; checks every record first (TraceError
    naming the file and line, as :func:`read_trace`). Its block size is inferred as
    :func:`read_trace` does. Memory: a few integers, whatever the trace's length. A file
    not sorted by timestamp is read whole instead (a :class:`Trace`)."""
    p = Path(path)
    if block_tokens is not None and block_tokens <= 0:
        raise TraceError(str(p), f"block size must be > 0, got {block_tokens}")
    fits = dict.fromkeys(_BLOCK_CANDIDATES, True)  # block sizes that explain every request so far
    count = prompt = 0
    tokens_only = False
    first = last = 0
    latest = 0.0
    for _, r in _records(p):
        ts = r["timestamp"]
        if count and ts < latest:
            return read_trace(p, block_tokens)  # out of order: sorted in memory
        latest, last = ts, int(ts)
        first = last if not count else first
        count += 1
        prompt += int(r["input_length"])
        if "hash_ids" in r:
            for b in fits:
                fits[b] = fits[b] and len(r["hash_ids"]) == -(-r["input_length"] // b)
        else:
            tokens_only = True
    if not count:
        raise TraceError(str(p), "no request in it")
    source = "given"
    if block_tokens is None and tokens_only:
        block_tokens, source = DEFAULT_TOKEN_BLOCK, "default for prompt_token_ids"
    if block_tokens is None:
        block_tokens = next((b for b, ok in fits.items() if ok), None)
        source = "inferred"
        if block_tokens is None:
            raise TraceError(str(p), "no block size in 16..4096 gives every request ceil(input_length / B) "
                                     "hash_ids: give the trace's block size")
    return TraceFile(p, block_tokens, source, count, prompt, max(1.0, (last - first) / 1000.0))
