"""Secrets named by the config, read once at start-up (the edge), never logged.

Who calls it: the scheduler-side planner's constructor
(:class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`), once, at start-up: so that
``plan/`` itself does no I/O.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from vllm_kvtier.config.files import read_small_file
from vllm_kvtier.config.peer import NixlTierConfig
from vllm_kvtier.errors import ConfigError

MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 4096


def load_remote_decode_secret(cfg: NixlTierConfig, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The prefill side's shared secret: ``nixl.remote_decode_secret_file`` if set (a small
    regular file, not readable by group or other), else the environment variable
    ``nixl.remote_decode_secret_env``; None when neither holds one. Surrounding whitespace
    is dropped. Raises ConfigError (naming the field, never the value) for a secret that
    cannot be read or is shorter than :data:`MIN_SECRET_CHARS`."""
    env = os.environ if environ is None else environ
    if cfg.remote_decode_secret_file is not None:
        where = "nixl.remote_decode_secret_file"
        path = Path(cfg.remote_decode_secret_file)
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            raise ConfigError(where, f"cannot read the secret file: {e.strerror}") from None
        if not stat.S_ISREG(mode) or mode & 0o077:
            raise ConfigError(where, f"must be a regular file readable by its owner only (chmod 600), mode "
                                     f"{stat.S_IMODE(mode):o}")
        try:
            value: str | None = read_small_file(path, MAX_SECRET_CHARS)
        except ValueError as e:
            raise ConfigError(where, str(e)) from None
    else:
        where = f"nixl.remote_decode_secret_env (environment variable {cfg.remote_decode_secret_env})"
        value = env.get(cfg.remote_decode_secret_env)
    value = (value or "").strip()
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(where, f"the secret must have at least {MIN_SECRET_CHARS} characters")
    return value.encode()
