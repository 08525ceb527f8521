"""What the tests of NIXL as an I/O engine (tests of the NVMe and S3 stores with
``io_engine: nixl``) share: the skip marker, the environment, and a skip for a plugin that
is present but does not load here (the reason says which and why).

Import ``nixl_env`` into a test module to use the fixture, and ``nixl_engine_env`` to give
it to every test marked ``nixl`` there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TypeVar

import pytest

from vllm_kvtier.errors import ConfigError

HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12", "nixl_cu13"))
requires_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="nixl is not installed (run tools/setup-remote.sh)")

T = TypeVar("T")


@pytest.fixture
def nixl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RDMA here: keep UCX's InfiniBand module out (a process that loaded UCX can crash
    at exit where libibverbs' provider plugins are installed), and NIXL's INFO lines."""
    monkeypatch.setenv("UCX_MODULES", "^ib")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")


@pytest.fixture(autouse=True)
def nixl_engine_env(request: pytest.FixtureRequest) -> None:
    """Where imported: the NIXL environment for each test marked ``nixl``."""
    if "nixl" in request.keywords:
        request.getfixturevalue("nixl_env")


def or_skip(make: Callable[[], T]) -> T:
    """``make()``, or skip the test when it says a NIXL plugin does not load or start here
    (e.g. GDS without CUDA, OBJ in the nixl-cu13 build). Any other error fails the test."""
    try:
        return make()
    except ConfigError as e:
        if "plugin, which does not" in str(e):
            pytest.skip(str(e))
        raise
