"""Tests write only under their temporary directories: the plugin's own cache included."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_kvtier.engine.identity import digest_cache_dir


def test_the_weights_digest_cache_of_a_test_session_is_temporary(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.getbasetemp().resolve()
    auto = digest_cache_dir("auto")
    assert auto is not None and base in auto.resolve().parents
    assert not auto.resolve().is_relative_to(Path.home().resolve() / ".cache")
    # an engine or server a test starts inherits this process's environment
    assert Path(os.environ["XDG_CACHE_HOME"]).resolve() in auto.resolve().parents
