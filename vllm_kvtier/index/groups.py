"""KV cache groups of a hybrid model.

It says what a stored unit of each group is and its key. It says which blocks of a
sliding-window group a later request can use.

vLLM's hybrid KV cache manager splits a model's attention layers into *groups* of one
kind (full attention, sliding-window attention). Each has its own block table. A block
position of a sliding-window group outside the window holds vLLM's null block (id 0).
A stored unit here is (group ``g``, block position ``p``): the rows of every KV plane at
that group's engine block. Its key:

* ``g == 0``: vLLM's block hash unchanged. A single-group model keeps its keys and its
  namespace, so nothing stored before is lost.
* ``g >= 1``: :func:`group_key` of the hash (a different unit of the same prefix).

Sliding-window arithmetic (:func:`window_start`): take a request whose first ``m`` blocks
are computed. In a sliding group of window ``w`` tokens and block size ``bs``, it reads
only the blocks from ``window_start(m)`` on. This is vLLM's
``SlidingWindowManager.get_num_skipped_tokens``: ``max(0, m*bs - w + 1)`` tokens are
skipped. So a hit of ``m`` blocks needs that group's keys at ``[window_start(m), m)``
only. Saving a sliding block is worth it only if it lies in such a window. The window must
be for a boundary ``m`` a later request may stop at (:class:`SaveFilter`).

No vLLM import here: the connector reads vLLM's specs into :class:`GroupLayout`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

GroupKind = Literal["full", "sliding"]

_GROUP_TAG = b"kvtier-group"


def group_key(block_hash: bytes, group: int) -> bytes:
    """The key of group ``group``'s unit at the block whose vLLM hash is ``block_hash``.

    It is the hash itself for group 0. Otherwise it is a 32-byte digest of (tag, group,
    hash)."""
    if group == 0:
        return block_hash
    if not 0 < group < 2**32:
        raise ValueError(f"group index {group} out of range")
    return hashlib.blake2b(_GROUP_TAG + group.to_bytes(4, "big") + bytes(block_hash), digest_size=32).digest()


def window_start(m: int, window: int, block_size: int) -> int:
    """First block position a request with blocks ``[0, m)`` computed still reads in a
    sliding-window group (``window`` tokens; 0 = full attention: position 0)."""
    if window <= 0:
        return 0
    return max(0, m * block_size - window + 1) // block_size


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: its attention kind, sliding window (tokens, 0 for full), block
    size (tokens) and number of layers."""

    kind: GroupKind
    block_size: int
    sliding_window: int = 0
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("full", "sliding"):
            raise ValueError(f"group kind must be 'full' or 'sliding', got {self.kind!r}")
        if self.block_size < 1:
            raise ValueError(f"group block size must be >= 1, got {self.block_size}")
        if (self.kind == "sliding") != (self.sliding_window > 0):
            raise ValueError("a sliding group needs a sliding window > 0, a full group none")

    def window_start(self, m: int) -> int:
        return window_start(m, self.sliding_window, self.block_size)

    def describe(self) -> str:
        kind = "full" if self.kind == "full" else f"sliding{self.sliding_window}"
        return f"{kind}:{self.block_size}:{self.num_layers}"


@dataclass(frozen=True)
class GroupLayout:
    """The KV cache groups of an engine, in vLLM's order (group index = position)."""

    groups: tuple[GroupSpec, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a group layout needs at least one group")

    @property
    def hybrid(self) -> bool:
        """More than one group: units are per group and loads are request-level."""
        return len(self.groups) > 1

    def describe(self) -> str:
        """The namespace field: empty for a single group (today's namespaces unchanged)."""
        return "" if not self.hybrid else ",".join(g.describe() for g in self.groups)

    @property
    def full_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.kind == "full"]

    @property
    def sliding_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.kind == "sliding"]


def sliding_hit(present: Sequence[bool], upto: int, spec: GroupSpec, floor: int = 0) -> int:
    """The largest ``m`` in ``(floor, upto]`` such that a sliding group's units at
    ``[spec.window_start(m), m)`` are all ``present`` (``present[p]`` for positions
    ``0..upto-1``), or ``floor`` if none. Positions below ``floor`` count as present
    (the engine has them already)."""
    for m in range(upto, floor, -1):
        lo = max(spec.window_start(m), floor)
        if all(present[p] for p in range(lo, m)):
            return m
    return floor


class SaveFilter:
    """Which block positions of a sliding group's request are worth storing.

    Those in ``[window_start(b), b)`` for a boundary ``b`` a later request may stop at.
    These are the boundaries.

    * The prompt's repeat boundary (``(num_prompt_tokens - 1) // bs``: the same prompt
      again).
    * Its full prompt blocks (``num_prompt_tokens // bs``: a later turn extends it).
    * Every multiple of the checkpoint interval within the prompt (a prompt sharing a long
      prefix).
    * At the end, the request's final boundary (:meth:`with_final`).

    Positions past the prompt (decode blocks) are kept while the request runs. At its end
    the ones outside every window are dropped again (:meth:`keep`)."""

    def __init__(self, spec: GroupSpec, num_prompt_tokens: int, checkpoint_blocks: int) -> None:
        self.spec = spec
        bs = spec.block_size
        self.prompt_blocks = num_prompt_tokens // bs
        bounds = {max(0, (num_prompt_tokens - 1) // bs), self.prompt_blocks}
        if checkpoint_blocks > 0:
            bounds.update(range(checkpoint_blocks, self.prompt_blocks + 1, checkpoint_blocks))
        self._bounds = sorted(b for b in bounds if b > 0)
        self._final: int | None = None

    def with_final(self, final: int) -> None:
        """The request ended with blocks ``[0, final)`` complete: decode positions are
        kept from now on only in that boundary's window."""
        self._final = final

    def boundaries(self) -> list[int]:
        return self._bounds + ([self._final] if self._final else [])

    def keep(self, p: int) -> bool:
        if p >= self.prompt_blocks and self._final is None:
            return True  # a decode block of a running request: its window is still ahead
        return any(self.spec.window_start(b) <= p < b for b in self.boundaries())

    def __call__(self, p: int) -> bool:
        return self.keep(p)


class GroupKeys(Sequence[bytes]):
    """A live view of a request's ``block_hashes`` through :func:`group_key` for one group.

    The request is anything with that attribute: vLLM's request or a LoRA view. Derived
    keys are cached by position. They are recorded in ``origins`` (if given) for
    :class:`KeyOrigins`."""

    def __init__(self, request: Any, group: int, origins: KeyOrigins | None = None) -> None:
        self._request = request
        self._group = group
        self._origins = origins
        self._derived: list[bytes] = []

    def _upto(self, n: int) -> None:
        base = self._request.block_hashes
        for i in range(len(self._derived), min(n, len(base))):
            h = base[i]
            k = group_key(h, self._group)
            self._derived.append(k)
            if self._origins is not None:
                self._origins.note(k, h, self._group)

    def __len__(self) -> int:
        return len(self._request.block_hashes)

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        n = len(self)
        if isinstance(i, slice):
            idx = range(*i.indices(n))
            if idx:
                self._upto(max(idx) + 1)
            return [self._derived[j] for j in idx]
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(i)
        self._upto(j + 1)
        return self._derived[j]


class KeyOrigins:
    """A bounded map from a derived key back to (vLLM's block hash, group index).

    It holds the keys derived in this process. KV events name a block by its hash and
    group. The oldest entries go first once ``max_entries`` are held. Group 0 keys are
    their own hash and are not recorded."""

    def __init__(self, max_entries: int = 1 << 20) -> None:
        self._max = max_entries
        self._map: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()

    def note(self, key: bytes, block_hash: bytes, group: int) -> None:
        if group == 0:
            return
        self._map[key] = (block_hash, group)
        self._map.move_to_end(key)
        while len(self._map) > self._max:
            self._map.popitem(last=False)

    def origin(self, key: bytes) -> tuple[bytes, int]:
        """(hash, group) of ``key``; a key never derived here is taken as a group-0 hash."""
        return self._map.get(key, (key, 0))

    def __len__(self) -> int:
        return len(self._map)


def layout_from_specs(specs: Iterable[tuple[str, int, int, int]]) -> GroupLayout:
    """A layout from (kind, block size, sliding window, layer count) per group."""
    return GroupLayout(tuple(GroupSpec(kind, bs, sw, n) for kind, bs, sw, n in specs))  # type: ignore[arg-type]
