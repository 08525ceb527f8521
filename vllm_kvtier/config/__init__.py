"""The plugin's configuration: typed frozen sections (:mod:`.sections` and the modules it
names), the stores' connection settings (:mod:`.stores`) and the parser (:mod:`.parse`).

It sits at the bottom of the house. The tiers import from here, never the reverse; config
imports only ``keys`` and ``errors``."""

from vllm_kvtier.config.cpu import CPUTierConfig
from vllm_kvtier.config.integrity import AuthConfig, FaultInjectionConfig, VerifyConfig
from vllm_kvtier.config.loading import LoadOrRecomputeConfig, PrefetchConfig, ScheduleConfig
from vllm_kvtier.config.lower import MooncakeTierConfig, NVMeTierConfig, S3TierConfig
from vllm_kvtier.config.parse import PRESET_DIR, available_presets, parse_config
from vllm_kvtier.config.peer import NixlTierConfig
from vllm_kvtier.config.reporting import EventsConfig, ExporterConfig
from vllm_kvtier.config.sections import KVTierConfig, LoadMode
from vllm_kvtier.config.stores import MooncakeConfig, NixlConfig, S3Config

__all__ = [
    "PRESET_DIR", "AuthConfig", "CPUTierConfig", "EventsConfig", "ExporterConfig", "FaultInjectionConfig", "KVTierConfig", "LoadMode",
    "LoadOrRecomputeConfig", "MooncakeConfig", "MooncakeTierConfig", "NVMeTierConfig", "NixlConfig",
    "NixlTierConfig", "PrefetchConfig", "S3Config", "S3TierConfig", "ScheduleConfig", "VerifyConfig", "available_presets", "parse_config",
]
