"""How the planners see a vLLM request.

A LoRA request's keys are bound to its adapter's content (:class:`AdapterRequest`). A
request of a hybrid model is one view per KV cache group (:class:`GroupView`).

Who calls it: :class:`~vllm_kvtier.engine.scheduler.GroupedPlanner`, from vLLM's
scheduler thread only. Each view is made once per request and kept until it finishes:
:class:`AdapterViews` and :class:`GroupViews` hold them (at most :data:`MAX_VIEWS` each).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm_kvtier.index.adapters import AdapterFingerprints, AdapterKeys
from vllm_kvtier.index.groups import GroupKeys, GroupLayout, KeyOrigins
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters

logger = logging.getLogger("vllm_kvtier")

#: Request views kept at most (one per live request; vLLM finishes each).
MAX_VIEWS = 65536


class AdapterRequest:
    """A LoRA request as the planners see it.

    It is vLLM's live ``Request`` with its block hashes bound to the adapter's content
    (:class:`~vllm_kvtier.index.adapters.AdapterKeys`). vLLM folds only the adapter's
    *name* into its block hashes. Without this, a rewritten adapter under the same name
    would be served its old KV. ``adapter`` None means no fingerprint could be taken. Then
    there are no block hashes, so the request neither loads from nor saves to the tiers."""

    def __init__(self, request: Any, adapter: bytes | None) -> None:
        self.live = request
        self._keys: Sequence[bytes] = AdapterKeys(request, adapter) if adapter is not None else ()

    @property
    def block_hashes(self) -> Sequence[bytes]:
        return self._keys

    def __getattr__(self, name: str) -> Any:  # everything else: the live request's
        return getattr(self.live, name)


#: Separates a request id from its group in a :class:`GroupView`'s id.
GROUP_SEP = "\x1fg"


def view_id(req_id: str, group: int) -> str:
    return f"{req_id}{GROUP_SEP}{group}"


def real_id(req_id: str) -> str:
    """vLLM's request id of a group view's id (an id without a group: itself)."""
    return req_id.rpartition(GROUP_SEP)[0] or req_id


class GroupView:
    """One KV cache group of a live request as the planners see it.

    It has its own id and the group's keys (:class:`~vllm_kvtier.index.groups.GroupKeys`;
    group 0: the request's own). Everything else is the live request's. ``base`` is
    vLLM's request or a LoRA view."""

    def __init__(self, base: Any, group: int, origins: KeyOrigins | None = None) -> None:
        self.live = base
        self.group = group
        self.request_id = view_id(base.request_id, group)
        self._keys: Sequence[bytes] | None = GroupKeys(base, group, origins) if group else None

    @property
    def block_hashes(self) -> Sequence[bytes]:
        return self._keys if self._keys is not None else self.live.block_hashes

    def __getattr__(self, name: str) -> Any:  # everything else: the live request's
        return getattr(self.live, name)


class AdapterViews:
    """The view of each live LoRA request, the same object on every hook until it
    finishes. A request without an adapter is its own view."""

    def __init__(self, counters: Counters) -> None:
        self._fingerprints = AdapterFingerprints()
        self._views: dict[str, AdapterRequest] = {}
        self._counters = counters

    def view(self, request: Any) -> Any:
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return request
        view = self._views.get(request.request_id)
        if view is not None and view.live is request:
            return view
        path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", ""))
        try:
            adapter: bytes | None = self._fingerprints.get(path)
        except OSError as e:
            adapter = None
            self._counters.add(CounterName.LORA_UNKEYED_REQUESTS, TierName.ALL)
            logger.warning("kvtier: LoRA adapter %r at %r cannot be fingerprinted (%s): its requests skip the "
                           "tiers", getattr(lora, "lora_name", ""), path, e)
        if len(self._views) >= MAX_VIEWS:  # looked up and never finished: forget the oldest
            self._views.pop(next(iter(self._views)))
        view = self._views[request.request_id] = AdapterRequest(request, adapter)
        return view

    def forget(self, req_id: str) -> None:
        """``req_id`` finished."""
        self._views.pop(req_id, None)


class GroupViews:
    """The views of each live request, one per KV cache group of ``layout``, the same
    objects until it finishes."""

    def __init__(self, layout: GroupLayout) -> None:
        self.layout = layout
        #: derived key -> (vLLM's hash, group), for the keys derived here (KV events)
        self.key_origins = KeyOrigins()
        self._views: dict[str, tuple[GroupView, ...]] = {}

    def views(self, base: Any) -> tuple[GroupView, ...]:
        """The views of ``base`` (vLLM's request or its LoRA view)."""
        views = self._views.get(base.request_id)
        if views is not None and views[0].live is base:
            return views
        if len(self._views) >= MAX_VIEWS:
            self._views.pop(next(iter(self._views)))
        views = self._views[base.request_id] = tuple(
            GroupView(base, g, self.key_origins) for g in range(len(self.layout.groups)))
        return views

    def forget(self, req_id: str) -> None:
        """``req_id`` finished."""
        self._views.pop(req_id, None)
