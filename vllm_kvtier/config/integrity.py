"""The sections on trusting stored KV: ``auth`` (chunks carry a MAC), ``verify`` (sampled
hits recomputed and compared) and ``fault_injection`` (deliberate failures, for drills)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from vllm_kvtier.config.checks import in_range
from vllm_kvtier.errors import ConfigError

#: ``verify.quarantine_s`` at most (30 days: "until restart" for any real deployment).
MAX_QUARANTINE_S = 30 * 86400.0


@dataclass(frozen=True)
class FaultInjectionConfig:
    """Deliberate failures, for fault drills and tests. Off unless a rate is set."""

    #: Probability that one block load fails (the block is then recomputed).
    load_error_rate: float = 0.0
    seed: int = 0


    def __post_init__(self) -> None:
        in_range("fault_injection.load_error_rate", self.load_error_rate, 0, 1)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
#: Verify keys (``auth.verify_key_files`` and ``auth.verify_key_envs``) at most.
MAX_VERIFY_KEYS = 8


@dataclass(frozen=True)
class AuthConfig:
    """Authenticated chunks (MACs) for the tiers below CPU: WHERE the key is, never the key.

    With a key found, the shared tiers (s3, mooncake) sign what they write. Every chunk and
    pool object carries a MAC over its header and blocks. Every read verifies it before a
    block is used. A chunk without a valid MAC is a miss (``kvtier_auth_failures_total``).
    Without a key, write access to the bucket or the pool is control over every reader's
    output. See :mod:`vllm_kvtier.tiers.auth` for the format."""

    #: Environment variable holding the key as hex (64+ hex digits = 32+ bytes), read when
    #: ``key_file`` is not set. Unset or empty: no key.
    key_env: str = "KVTIER_AUTH_KEY"
    #: A file holding the key as hex (a mounted secret): absolute path; it must not be
    #: readable by group or other (mode 0600/0400) unless ``allow_readable_key_file``.
    key_file: str | None = None
    #: Refuse to start when no key is found (never run unauthenticated by accident).
    required: bool = False
    #: Sign and verify the local tier (nvme) too; off: only the shared tiers (s3, mooncake).
    local_tiers: bool = False
    #: Accept a key file that group or other can read (some secret mounts are 0644).
    allow_readable_key_file: bool = False
    #: Key rotation: files (absolute paths, same rules as ``key_file``) each holding one more
    #: key as hex, accepted on reads but never used to sign. Every one must hold a key.
    verify_key_files: tuple[str, ...] = ()
    #: Key rotation: environment variables each holding one more key as hex, accepted on
    #: reads but never used to sign. Every one must be set.
    verify_key_envs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _ENV_NAME.fullmatch(self.key_env):
            raise ConfigError("auth.key_env", f"must be an environment variable name, got {self.key_env!r}")
        if self.key_file is not None and ("\0" in self.key_file or not self.key_file.startswith("/")):
            raise ConfigError("auth.key_file", "must be an absolute path without NUL bytes")
        if len(self.verify_key_files) + len(self.verify_key_envs) > MAX_VERIFY_KEYS:
            raise ConfigError("auth.verify_key_files", f"at most {MAX_VERIFY_KEYS} verify keys in all (with "
                                                       "auth.verify_key_envs)")
        for i, f in enumerate(self.verify_key_files):
            if not isinstance(f, str) or "\0" in f or not f.startswith("/"):
                raise ConfigError(f"auth.verify_key_files[{i}]", "must be an absolute path without NUL bytes")
        for i, e in enumerate(self.verify_key_envs):
            if not isinstance(e, str) or not _ENV_NAME.fullmatch(e):
                raise ConfigError(f"auth.verify_key_envs[{i}]", f"must be an environment variable name, got {e!r}")


@dataclass(frozen=True)
class VerifyConfig:
    """Shadow verification: a sampled hit is recomputed instead of loaded.

    Its stored blocks are read from their tier into CPU slots, as a load would. They are
    compared with the freshly computed ones. A mismatch is counted, logged and may
    quarantine the tier. ``sample_rate: 0`` (default) takes no code path at all."""

    #: Share of hits (requests that would load blocks from a tier) verified, in [0, 1];
    #: 1.0 verifies every hit (and so serves none: each is recomputed).
    sample_rate: float = 0.0
    #: Seed of the sampling draws (deterministic for a given request order).
    seed: int = 0
    #: "auto": bitwise first, then normwise per plane (one layer's rows of the block):
    #: max |stored - computed| <= ``atol`` + ``rtol`` x max |computed|, defaults by KV
    #: dtype (docs/configuration.md); "exact": bitwise only.
    tolerance: Literal["auto", "exact"] = "auto"
    #: Override the dtype default's absolute / relative tolerance (``tolerance: auto`` only).
    atol: float | None = None
    rtol: float | None = None
    #: After ``quarantine_mismatches`` mismatching checks, the tier serves no hits for this
    #: long (its lookups answer miss; saves to it continue). 0: no quarantine (counted and
    #: logged only).
    quarantine_s: float = 0.0
    #: Checks of one tier that found a wrong block, within ``quarantine_window_s``, that
    #: quarantine it. One wrong block is dropped at once; quarantine is for a tier that
    #: keeps serving them, not for one false alarm. 1: the first mismatch quarantines.
    quarantine_mismatches: int = 3
    quarantine_window_s: float = 600.0


    def __post_init__(self) -> None:
        in_range("verify.sample_rate", self.sample_rate, 0, 1)
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if value is not None:
                in_range(f"verify.{name}", value, 0, 1e6)
                if self.tolerance == "exact":
                    raise ConfigError(f"verify.{name}", "must not be set with tolerance: exact (bitwise)")
        in_range("verify.quarantine_s", self.quarantine_s, 0, MAX_QUARANTINE_S)
        if type(self.quarantine_mismatches) is not int:
            raise ConfigError("verify.quarantine_mismatches", f"must be an integer, got {self.quarantine_mismatches!r}")
        in_range("verify.quarantine_mismatches", self.quarantine_mismatches, 1, 1000)
        in_range("verify.quarantine_window_s", self.quarantine_window_s, 1, MAX_QUARANTINE_S)
