"""Synthetic traces for ``kvtier plan --trace``, deterministic from a seed.

``docqa``: document question answering. A few long documents are shared prefixes; each
request asks one question about one document, so its tail is a one-off. Popularity is
Zipf-like and drifts: the hot documents change over the trace. The reuse structure is
the opposite of a chat trace's: the heads are reused by many requests, the tails never.

Output: records in the trace file format (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``), ready for :func:`~vllm_kvtier.ops.trace_sim.make_trace`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class DocQASpec:
    requests: int = 6000
    documents: int = 400
    #: document length in blocks: uniform in [min, max]
    doc_blocks_min: int = 8
    doc_blocks_max: int = 64
    #: question (the one-off tail) length in blocks: uniform in [min, max]
    tail_blocks_min: int = 1
    tail_blocks_max: int = 6
    #: Zipf exponent of document popularity
    zipf_s: float = 0.9
    #: the popularity ranking is reshuffled this many times over the trace
    phases: int = 4
    #: requests per second (Poisson arrivals)
    rate_per_s: float = 4.0
    block_tokens: int = 512
    seed: int = 0


def docqa_records(spec: DocQASpec = DocQASpec()) -> list[dict]:
    """A document-QA trace (module doc). Ids: one system block (0) shared by every request,
    then the document's blocks, then the question's blocks, each id used by one prefix."""
    if spec.requests < 1 or spec.documents < 1 or not 1 <= spec.doc_blocks_min <= spec.doc_blocks_max \
            or not 1 <= spec.tail_blocks_min <= spec.tail_blocks_max or spec.phases < 1 or spec.rate_per_s <= 0:
        raise ValueError(f"bad document-QA spec: {spec}")
    rng = random.Random(spec.seed)
    next_id = 1
    docs: list[list[int]] = []
    for _ in range(spec.documents):
        n = rng.randint(spec.doc_blocks_min, spec.doc_blocks_max)
        docs.append(list(range(next_id, next_id + n)))
        next_id += n
    weights = [1.0 / (r + 1) ** spec.zipf_s for r in range(spec.documents)]
    order = list(range(spec.documents))
    per_phase = -(-spec.requests // spec.phases)
    out = []
    t_ms = 0.0
    for i in range(spec.requests):
        if i % per_phase == 0:
            rng.shuffle(order)  # which document holds which popularity rank
        doc = docs[order[rng.choices(range(spec.documents), weights)[0]]]
        tail = rng.randint(spec.tail_blocks_min, spec.tail_blocks_max)
        ids = [0, *doc, *range(next_id, next_id + tail)]
        next_id += tail
        last = rng.randint(1, spec.block_tokens)  # the question's last block is partial
        out.append({"timestamp": int(t_ms), "input_length": (len(ids) - 1) * spec.block_tokens + last,
                    "output_length": rng.randint(16, 512), "hash_ids": ids})
        t_ms += rng.expovariate(spec.rate_per_s) * 1000.0
    return out
