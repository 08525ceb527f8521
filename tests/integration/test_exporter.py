"""The standalone exporter: the plugin's metrics on a registry of the caller's, served over
HTTP by prometheus_client, scraped here on a free port of 127.0.0.1."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from vllm_kvtier.exporter import StandaloneExporter
from vllm_kvtier.metrics import CounterName, Counters, GaugeName, HistogramName

STEP1 = {
    "counters": {"blocks_loaded|cpu": 3, "bytes_loaded|cpu": 3 * 4096, "hit_blocks|nvme": 0},
    "gauges": {"usage_bytes|nvme": 100.0, "breaker_state|s3": 2},
    "histograms": {
        "request_load_wait_seconds|s3": [0.003, 0.2],
        "request_loaded_blocks|cpu": [5],
    },
}
STEP2 = {
    "counters": {"blocks_loaded|cpu": 4, "not_a_metric|cpu": 1},
    "gauges": {"usage_bytes|nvme": 50.0},
    "histograms": {"request_load_wait_seconds|s3": [40.0], "not_a_histogram|cpu": [1.0]},
}


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics`` as ``{sample name: [(labels, value), ...]}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(samples, name: str, **labels: str) -> float:
    (v,) = [v for lab, v in samples.get(name, []) if lab == labels]
    return v


@pytest.fixture
def exporter():
    exp = StandaloneExporter(CollectorRegistry(), labels={"model_name": "tiny"})
    yield exp
    exp.stop()


def test_serves_counters_gauges_and_histograms_over_http(exporter):
    port = exporter.start(0, "127.0.0.1")
    assert port and exporter.port == port
    exporter.observe(STEP1)
    exporter.observe(STEP2)
    got = scrape(port)

    assert value(got, "kvtier_blocks_loaded_total", model_name="tiny", tier="cpu") == 7
    assert value(got, "kvtier_bytes_loaded_total", model_name="tiny", tier="cpu") == 3 * 4096
    assert "kvtier_hit_blocks_total" not in got  # a zero delta makes no series
    assert value(got, "kvtier_usage_bytes", model_name="tiny", tier="nvme") == 50.0  # the latest
    assert value(got, "kvtier_breaker_state", model_name="tiny", tier="s3") == 2

    s3 = {"model_name": "tiny", "tier": "s3"}
    assert value(got, "kvtier_request_load_wait_seconds_count", **s3) == 3
    assert value(got, "kvtier_request_load_wait_seconds_sum", **s3) == pytest.approx(40.203)
    buckets = {lab["le"]: v for lab, v in got["kvtier_request_load_wait_seconds_bucket"] if lab["tier"] == "s3"}
    assert buckets["0.001"] == 0 and buckets["0.005"] == 1 and buckets["0.25"] == 2
    assert buckets["30.0"] == 2 and buckets["+Inf"] == 3  # 40 s is past the last bucket
    cpu = {"model_name": "tiny", "tier": "cpu"}
    assert value(got, "kvtier_request_loaded_blocks_count", **cpu) == 1
    assert value(got, "kvtier_request_loaded_blocks_bucket", le="4.0", **cpu) == 0
    assert value(got, "kvtier_request_loaded_blocks_bucket", le="8.0", **cpu) == 1
    assert value(got, "kvtier_request_loaded_blocks_bucket", le="4096.0", **cpu) == 1
    # Undeclared names (a newer worker's) are ignored, not served.
    assert not [n for n in got if "not_a_" in n]


def test_every_declared_metric_is_exposed_with_its_help(exporter):
    port = exporter.start(0, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for m in CounterName:
        assert families[f"kvtier_{m}"].type == "counter" and families[f"kvtier_{m}"].documentation == m.help
    for m in GaugeName:
        assert families[f"kvtier_{m}"].type == "gauge" and families[f"kvtier_{m}"].documentation == m.help
    for m in HistogramName:
        assert families[f"kvtier_{m}"].type == "histogram"
        assert families[f"kvtier_{m}"].documentation == m.help
    assert not [n for n in families if not n.startswith("kvtier_") and not n.startswith(("python_", "process_"))]


def test_feeds_from_counters_drain_and_never_touches_the_global_registry(exporter):
    c = Counters()
    c.add("blocks_stored", "nvme", 6)
    c.observe("request_loaded_blocks", "nvme", 6)
    c.observe("request_load_wait_seconds", "nvme", 0.02)
    data = c.drain()
    assert data is not None
    exporter.observe(data)
    reg = exporter.registry
    assert reg.get_sample_value("kvtier_blocks_stored_total", {"model_name": "tiny", "tier": "nvme"}) == 6
    assert reg.get_sample_value("kvtier_request_loaded_blocks_sum", {"model_name": "tiny", "tier": "nvme"}) == 6
    assert reg.get_sample_value(
        "kvtier_request_load_wait_seconds_bucket", {"model_name": "tiny", "tier": "nvme", "le": "0.025"}) == 1
    assert REGISTRY.get_sample_value("kvtier_blocks_stored_total", {"model_name": "tiny", "tier": "nvme"}) is None
    # Two exporters side by side: each registry its own (no duplicate-timeseries error).
    other = StandaloneExporter(CollectorRegistry())
    other.observe(data)
    assert other.registry.get_sample_value("kvtier_blocks_stored_total", {"tier": "nvme"}) == 6


def test_stop_closes_the_port_and_start_twice_is_refused(exporter):
    port = exporter.start(0, "127.0.0.1")
    with pytest.raises(RuntimeError, match="already serving"):
        exporter.start(0, "127.0.0.1")
    exporter.stop()
    assert exporter.port is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    exporter.stop()  # harmless


def test_engine_serves_the_standalone_endpoint(tiny_model):
    """``exporter.port`` on a real engine: the scheduler process serves kvtier_* metrics,
    the workers' figures included (a repeated prompt's CPU loads)."""
    import random
    import socket

    from tests.conftest import close_llm, generate, kvtier_config, make_llm, rand_tokens

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompt = rand_tokens(random.Random(7), 200)
    llm = make_llm(tiny_model, kvtier_config({"exporter": {"port": port, "addr": "127.0.0.1"}}))
    try:
        generate(llm, prompt)
        again = generate(llm, prompt)
        got = scrape(port)
    finally:
        close_llm(llm)
    assert again.loaded > 0
    loaded = {lab["tier"]: v for lab, v in got["kvtier_blocks_loaded_total"]}
    assert loaded["cpu"] == again.loaded
    assert any(v > 0 for _, v in got["kvtier_blocks_stored_total"])
