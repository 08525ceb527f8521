"""The ``nixl`` section: prefill/decode disaggregation, peer to peer."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from vllm_kvtier.config.checks import at_least, at_most, positive
from vllm_kvtier.config.stores import NixlConfig, check_bounds
from vllm_kvtier.errors import ConfigError

#: NIXL peers a decode worker keeps connected at most (``nixl.max_peers`` at most).
MAX_NIXL_PEERS = 1024
#: Patterns in ``nixl.allowed_peers`` / ``nixl.trusted_peers`` at most.
MAX_PEER_PATTERNS = 256
_AGENT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_PEER_PATTERN = re.compile(r"^[A-Za-z0-9_.*?\[\]!-]{1,128}$")


@dataclass(frozen=True)
class NixlTierConfig:
    """Prefill/decode disaggregation peer to peer.

    The decode instance reads a prompt's blocks straight out of the prefill instance's CPU
    tier over NIXL. NIXL uses UCX: RDMA, or TCP / shared memory on one host. It uses the
    ``kv_transfer_params`` vLLM passes through the request. In YAML the section is flat:
    :class:`~vllm_kvtier.tiers.nixl.agent.NixlConfig`'s fields (backends, deadline_s,
    num_threads, progress_thread) sit next to ``hold_s``."""

    store: NixlConfig
    #: Prefill side: how long a finished request's blocks stay pinned for the decode side
    #: to read them; reclaimed then if no read came (a decode instance that died).
    hold_s: float = 60.0
    #: This instance's NIXL agents are named ``<agent_name>-<random>-r<rank>``: what a
    #: decode instance's ``allowed_peers`` matches (e.g. ``prefill`` here, ``prefill-*``
    #: there). Letters, digits, ``_.-``.
    agent_name: str = "kvtier"
    #: Decode side: the agents whose offers (``kvtier_peer`` in ``kv_transfer_params``,
    #: which a client can also send) are read, as shell-style patterns over the agent name
    #: (``prefill-*``) that NIXL itself reads from the offer's agent metadata. Empty (the
    #: default): no offer is read (the request recomputes; counted in
    #: ``request_params_ignored{tier="peer"}``). UCX addresses are opaque, so hosts cannot be
    #: matched: pair this with a network where only your prefill hosts reach the decode ones.
    allowed_peers: tuple[str, ...] = ()
    #: Decode side: agents (patterns, as above) whose blocks are also kept in this
    #: instance's CPU tier and written to its lower tiers like its own. Blocks from any other
    #: allowed peer serve their request only (``peer_unpromoted_blocks``), and nothing that
    #: request computes is stored. A trusted agent is also allowed.
    trusted_peers: tuple[str, ...] = ()
    #: Decode side: remote agents kept connected at most; the least recently used idle one
    #: is removed for a new one (``peers_removed``), and any is removed once idle for
    #: ``hold_s`` (its offers have expired by then). A read needing a new peer while every
    #: one has a read in flight is recomputed.
    max_peers: int = 16
    #: Prefill side: share of the CPU tier's slots that offers may hold pinned at once. Any
    #: request with ``do_remote_decode`` (a client can send one) makes an offer held for
    #: ``hold_s``; past this share the answer carries no offer (counted in
    #: ``request_params_ignored{tier="peer"}``) and the decode side recomputes.
    max_offered_fraction: float = 0.5
    #: Prefill side: answer ``do_remote_decode`` with an offer (every rank's NIXL agent
    #: metadata, memory registration included, and the prompt's slots pinned for
    #: ``hold_s``). vLLM's OpenAI server forwards ``kv_transfer_params`` from clients, so
    #: off (the default) a ``do_remote_decode`` is ignored and counted
    #: (``request_params_ignored{tier="peer"}``). Turn it on on prefill instances only, with
    #: a proxy in front that strips clients' ``kv_transfer_params`` (examples/pd_proxy.py),
    #: and preferably a shared secret (below).
    accept_remote_decode: bool = False
    #: Prefill side: the shared secret the P/D proxy proves it knows (a one-time token,
    #: ``kv_transfer_params.kvtier_pd_auth``: plan/pd_auth.py) is read from this environment
    #: variable, or from ``remote_decode_secret_file`` (absolute path, mode 0600/0400) when
    #: set. Found (16+ characters), a ``do_remote_decode`` without a valid token is refused
    #: (counted). Never logged. Not found: any ``do_remote_decode`` is answered.
    remote_decode_secret_env: str = "KVTIER_PD_SECRET"
    remote_decode_secret_file: str | None = None


    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", self.remote_decode_secret_env):
            raise ConfigError("nixl.remote_decode_secret_env",
                              f"must be an environment variable name, got {self.remote_decode_secret_env!r}")
        f = self.remote_decode_secret_file
        if f is not None and ("\0" in f or not f.startswith("/")):
            raise ConfigError("nixl.remote_decode_secret_file", "must be an absolute path without NUL bytes")
        positive("nixl.hold_s", self.hold_s)
        check_bounds("nixl", self, durations=("hold_s",))
        if not 0.0 < self.max_offered_fraction <= 0.9:
            raise ConfigError("nixl.max_offered_fraction", f"must be in (0, 0.9], got {self.max_offered_fraction}")
        if not _AGENT_NAME.match(self.agent_name):
            raise ConfigError("nixl.agent_name", f"1-64 letters, digits or _.-, got {self.agent_name!r}")
        for name in ("allowed_peers", "trusted_peers"):
            patterns = getattr(self, name)
            if len(patterns) > MAX_PEER_PATTERNS:
                raise ConfigError(f"nixl.{name}", f"at most {MAX_PEER_PATTERNS} patterns, got {len(patterns)}")
            for i, p in enumerate(patterns):
                if not isinstance(p, str) or not _PEER_PATTERN.match(p):
                    raise ConfigError(f"nixl.{name}[{i}]",
                                      f"an agent-name pattern (letters, digits, _.- and * ? [ ] !), got {p!r}")
        at_least("nixl.max_peers", self.max_peers, 1)
        at_most("nixl.max_peers", self.max_peers, MAX_NIXL_PEERS)

    def trusts_peer(self, agent_name: str) -> bool:
        """Whether blocks read from ``agent_name`` may be kept and stored (``trusted_peers``)."""
        return any(fnmatch.fnmatchcase(agent_name, p) for p in self.trusted_peers)

    def allows_peer(self, agent_name: str) -> bool:
        """Whether offers of ``agent_name`` are read at all (``allowed_peers`` or trusted)."""
        return self.trusts_peer(agent_name) or any(fnmatch.fnmatchcase(agent_name, p) for p in self.allowed_peers)
