"""A synthetic trace of many users reading a few shared documents (``kvtier plan --trace``
format), made deterministically from a seed: a structure unlike a chat trace's, where the
reusable prefix is long and shared by many conversations.

Each session picks one document (Zipf: a few are read by most users) and asks a few
questions in turn. A prompt is a system block, the document's blocks, the session's
earlier questions and answers (full blocks), then this turn's question, whose last block
is partial (a fresh id each turn, as in Mooncake's traces). Pure: no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class DocsTraceShape:
    seed: int = 7
    block_tokens: int = 512
    documents: int = 12
    #: blocks of a document (uniform in this range)
    doc_blocks: tuple[int, int] = (8, 48)
    zipf_s: float = 1.1
    sessions: int = 1500
    duration_s: float = 3600.0
    #: turns per session: 1 + geometric with this mean of extra turns
    mean_extra_turns: float = 3.0
    turn_gap_s: tuple[float, float] = (20.0, 120.0)
    #: full blocks a question and its answer add to the session's history
    turn_blocks: tuple[int, int] = (1, 3)
    output_tokens: tuple[int, int] = (50, 600)


def docs_trace(shape: DocsTraceShape = DocsTraceShape()) -> list[dict]:
    """The trace's records, sorted by timestamp (ms)."""
    rng = random.Random(shape.seed)
    next_id = 1
    system = [0]

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    docs = [fresh(rng.randint(*shape.doc_blocks)) for _ in range(shape.documents)]
    weights = [1.0 / (d + 1) ** shape.zipf_s for d in range(shape.documents)]
    out: list[dict] = []
    for _ in range(shape.sessions):
        doc = docs[rng.choices(range(shape.documents), weights)[0]]
        t = rng.uniform(0, shape.duration_s)
        history = fresh(rng.randint(*shape.turn_blocks))  # the first question's full blocks
        turns = 1
        while rng.random() < shape.mean_extra_turns / (1 + shape.mean_extra_turns):
            turns += 1
        for _turn in range(turns):
            if t > shape.duration_s:
                break
            full = system + doc + history
            partial = rng.randint(1, shape.block_tokens - 1)
            out.append({"timestamp": int(t * 1000), "input_length": len(full) * shape.block_tokens + partial,
                        "output_length": rng.randint(*shape.output_tokens), "hash_ids": full + fresh(1)})
            history = history + fresh(rng.randint(*shape.turn_blocks))
            t += rng.uniform(*shape.turn_gap_s)
    out.sort(key=lambda r: r["timestamp"])
    return out
