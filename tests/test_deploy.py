"""deploy/: the tools that consume each file accept it, and the files agree with the services.

docker-compose (1.29) resolves every compose file, promtool accepts the Prometheus config, the
Kubernetes manifests validate against the Kubernetes schemas, and every SPLITSPEC_* setting they
pass is a real flag of the service it names (a misspelt one would be silently ignored).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from splitspec.cli.main import build_parser
from tests.tools import require

DEPLOY = Path(__file__).parents[1] / "deploy"
COMPOSE_FILES = sorted(DEPLOY.glob("docker-compose*.yml"))
# The mixed NVIDIA side needs the AMD host's address; 192.0.2.1 is a documentation address.
COMPOSE_ENV = {**os.environ, "DRAFT_HOST_IP": "192.0.2.1"}
METRICS_PORTS = {"gateway": 9451, "target": 9452, "draft": 9453}
GRPC_PORTS = {"gateway": 50051, "target": 50052, "draft": 50053}
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.utils.latest_version()]  # 1.27: gRPC probes are GA


@functools.cache
def _env_names(service: str) -> set[str]:
    """The environment variables `splitspec SERVICE --help` lists."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([service, "--help"])
    return set(re.findall(r"\[env\s+(SPLITSPEC_\w+)\]", out.getvalue()))


def _check_settings(env: dict[str, str], where: str) -> None:
    for name in env:
        if name.startswith("SPLITSPEC_"):
            service = name.split("_")[1].lower()
            assert name in _env_names(service), f"{where}: {name} is not a flag of `splitspec {service}`"


@functools.cache
def _compose_config(path: Path) -> dict:
    compose = require("docker-compose", "docker-compose")
    done = subprocess.run([compose, "-f", str(path), "config"], capture_output=True, text=True, env=COMPOSE_ENV)
    assert done.returncode == 0, f"{path.name}: {done.stderr}"
    return yaml.safe_load(done.stdout)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=[p.name for p in COMPOSE_FILES])
def test_compose_file_resolves_and_its_services_fit_together(path):
    compose = require("docker-compose", "docker-compose")
    quiet = subprocess.run([compose, "-f", str(path), "config", "-q"], capture_output=True, text=True, env=COMPOSE_ENV)
    assert quiet.returncode == 0, quiet.stderr
    services = _compose_config(path)["services"]
    for name, service in services.items():
        _check_settings(service.get("environment", {}), f"{path.name} {name}")
        if name in GRPC_PORTS:
            env = service["environment"]
            prefix = f"SPLITSPEC_{name.upper()}_"
            assert env[prefix + "LISTEN"] == f"0.0.0.0:{GRPC_PORTS[name]}"  # reachable from the other containers
            assert env[prefix + "METRICS_PORT"] == str(METRICS_PORTS[name])
            assert f"127.0.0.1:{GRPC_PORTS[name]}" in service["healthcheck"]["test"]
    if "gateway" in services:
        env = services["gateway"]["environment"]
        assert env["SPLITSPEC_GATEWAY_TARGET"] == "target:50052" and env["SPLITSPEC_GATEWAY_DRAFT"] == "draft:50053"
        assert set(services["gateway"].get("depends_on", {})) == {"target", "draft"} & set(services)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=[p.name for p in COMPOSE_FILES])
def test_workers_put_their_step_sockets_where_a_gateway_on_their_host_finds_them(path):
    services = _compose_config(path)["services"]
    for name in {"target", "draft"} & set(services):
        socket = services[name]["environment"][f"SPLITSPEC_{name.upper()}_STEP_SOCKET"]
        assert socket == f"/run/splitspec/{name}.steps"
        assert "step-sockets:/run/splitspec:rw" in services[name]["volumes"]
    if "gateway" in services:
        assert "step-sockets:/run/splitspec:rw" in services["gateway"]["volumes"]


def test_cuda_compose_puts_the_target_on_gpu_0_and_the_draft_on_gpu_1():
    services = _compose_config(DEPLOY / "docker-compose.yml")["services"]
    for name, gpu in (("target", "0"), ("draft", "1")):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}
    assert set(services) == {"target", "draft", "gateway", "prometheus", "grafana"}


@pytest.mark.parametrize("name", ["docker-compose.rocm.yml", "docker-compose.mixed-amd.yml"])
def test_rocm_workers_get_the_amd_devices_and_groups(name):
    services = _compose_config(DEPLOY / name)["services"]
    for worker in {"target", "draft"} & set(services):
        assert {"/dev/kfd", "/dev/dri"} <= set(services[worker]["devices"])
        assert {"video", "render"} <= set(services[worker]["group_add"])
        assert "ROCR_VISIBLE_DEVICES" in services[worker]["environment"]
        assert "deploy" not in services[worker]  # no NVIDIA reservation


def test_mixed_compose_refuses_to_run_without_the_draft_host():
    compose = require("docker-compose", "docker-compose")
    env = {k: v for k, v in COMPOSE_ENV.items() if k != "DRAFT_HOST_IP"}
    done = subprocess.run([compose, "-f", str(DEPLOY / "docker-compose.mixed-nvidia.yml"), "config", "-q"], capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "set DRAFT_HOST_IP" in done.stderr


def test_prometheus_config_passes_promtool_and_scrapes_every_service():
    promtool = require("promtool", "prometheus")
    config = DEPLOY / "prometheus" / "prometheus.yml"
    done = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    targets = {t for job in yaml.safe_load(config.read_text())["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert {f"{name}:{port}" for name, port in METRICS_PORTS.items()} <= targets


def test_alert_rules_pass_promtools_checks_and_unit_tests_and_name_exported_metrics():
    """deploy/prometheus/alerts.yml: valid, loaded by prometheus.yml and mounted beside it, its
    unit tests (alerts_test.yml: each alert fires when it should and not before) pass, and every
    metric it names is one services/metrics.py exports (a counter with its _total suffix)."""
    promtool = require("promtool", "prometheus")
    folder = DEPLOY / "prometheus"
    for args in (["check", "rules", str(folder / "alerts.yml")], ["test", "rules", str(folder / "alerts_test.yml")]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    files = yaml.safe_load((folder / "prometheus.yml").read_text())["rule_files"]
    assert files == ["alerts.yml"]
    volumes = yaml.safe_load((DEPLOY / "services.yml").read_text())["services"]["prometheus"]["volumes"]
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in volumes
    source = (Path(__file__).parents[1] / "services" / "metrics.py").read_text()
    exported = set(re.findall(r'"(splitspec_[a-z_]+)"', source))
    named = set(re.findall(r"\bsplitspec_[a-z_]+", (folder / "alerts.yml").read_text()))
    assert named and {n.removesuffix("_total") for n in named} <= exported, named


def test_grafana_provisioning_matches_the_dashboard_and_the_mounts():
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/splitspec.yml").read_text())["providers"][0]
    dashboard = json.loads((DEPLOY / "grafana/dashboards/splitspec.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}
    assert datasource["url"] == "http://prometheus:9090"
    grafana = yaml.safe_load((DEPLOY / "services.yml").read_text())["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def _manifests() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_validate_against_the_schemas(version):
    manifests = _manifests()
    assert {doc["kind"] for _, doc in manifests} >= {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim"}
    for name, doc in manifests:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_kubernetes_workloads_probe_grpc_health_and_read_real_settings():
    manifests = _manifests()
    config = next(doc for _, doc in manifests if doc["kind"] == "ConfigMap")
    _check_settings(config["data"], "k8s/configmap.yaml")
    deployments = {doc["metadata"]["name"]: doc for _, doc in manifests if doc["kind"] == "Deployment"}
    assert deployments["splitspec-gateway"]["spec"]["replicas"] > 1
    for service, port in GRPC_PORTS.items():
        (container,) = deployments[f"splitspec-{service}"]["spec"]["template"]["spec"]["containers"]
        assert config["data"][f"SPLITSPEC_{service.upper()}_LISTEN"] == f"0.0.0.0:{port}"
        assert {p["containerPort"] for p in container["ports"]} == {port, METRICS_PORTS[service]}
        assert container["readinessProbe"]["grpc"]["port"] == container["livenessProbe"]["grpc"]["port"] == port
        assert container["readinessProbe"]["grpc"]["service"].startswith("splitspec.v1.")
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (None if service == "gateway" else 1)


def test_kubernetes_validation_rejects_a_broken_manifest():
    """The schema check is real: a wrong type is refused."""
    _, deployment = next((n, d) for n, d in _manifests() if d["kind"] == "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.rocm"])
def test_dockerfile_copies_only_what_exists_and_dockerignore_keeps(name):
    root = DEPLOY.parent
    kept = {line.strip().lstrip("!").rstrip("/") for line in (root / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for line in (DEPLOY / name).read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (root / source).exists() and source in kept, f"{name}: COPY {source}"


def test_a_missing_tool_fails_under_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"apt-get install -y prometheus"):
        require("promtool", "prometheus")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"promtool not found"):
        require("promtool", "prometheus")
