"""The plugin's configuration: typed frozen sections (:mod:`.sections`), the stores'
connection settings (:mod:`.stores`) and the parser (:mod:`.parse`), at the bottom of the
house: the tiers import from here, never the reverse (config imports only ``keys`` and
``errors``)."""

from vllm_kvtier.config.parse import PRESET_DIR, available_presets, parse_config
from vllm_kvtier.config.sections import (
    AuthConfig,
    CPUTierConfig,
    EventsConfig,
    ExporterConfig,
    FaultInjectionConfig,
    KVTierConfig,
    LoadMode,
    LoadOrRecomputeConfig,
    MooncakeTierConfig,
    NixlTierConfig,
    NVMeTierConfig,
    PrefetchConfig,
    S3TierConfig,
    ScheduleConfig,
    VerifyConfig,
)
from vllm_kvtier.config.stores import MooncakeConfig, NixlConfig, S3Config

__all__ = [
    "PRESET_DIR", "AuthConfig", "CPUTierConfig", "EventsConfig", "ExporterConfig", "FaultInjectionConfig", "KVTierConfig", "LoadMode",
    "LoadOrRecomputeConfig", "MooncakeConfig", "MooncakeTierConfig", "NVMeTierConfig", "NixlConfig",
    "NixlTierConfig", "PrefetchConfig", "S3Config", "S3TierConfig", "ScheduleConfig", "VerifyConfig", "available_presets", "parse_config",
]
