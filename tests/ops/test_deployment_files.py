"""The deployment files agree with the code: every SITS_* variable compose.yaml and ops/kubernetes set is
a real setting (or a variable the code reads), the kustomization lists the manifests there are, the
workloads are wired as a user expects (probes, the GPU request), and Redis gets the
settings of ops/redis/redis.conf. kubectl and docker do not run here: these are the checks they would
leave to the user.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.config.loading import load_settings

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "ops" / "kubernetes"
PROCESS_VARIABLES = {"SITS_CONFIG", "SITS_API_KEY", "SITS_WORKER_DEVICE", "SITS_WORKER_STREAMS"}
"""SITS_* variables the code reads besides the settings (the config file, the CLI's key, what `sitsctl
worker` tells the Celery process)."""


def kubernetes_documents() -> list[dict[str, Any]]:
    return [doc for path in sorted(KUBERNETES.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def kubernetes_variables() -> dict[str, str]:
    """Every SITS_* variable the manifests set: ConfigMaps' data and containers' env with a value."""
    found: dict[str, str] = {}
    for doc in kubernetes_documents():
        if doc["kind"] == "ConfigMap":
            found |= {name: value for name, value in doc["data"].items() if name.startswith("SITS_")}
        for container in containers(doc):
            found |= {env["name"]: env["value"] for env in container.get("env", [])
                      if env["name"].startswith("SITS_") and "value" in env}
    return found


def compose_variables() -> dict[str, str]:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    found: dict[str, str] = {}
    for service in [compose["x-sits"], *compose["services"].values()]:
        environment = service.get("environment") or {}
        found |= {name: str(value) for name, value in environment.items() if name.startswith("SITS_")}
    return found


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] not in ("Deployment", "StatefulSet"):
        return []
    return list(doc["spec"]["template"]["spec"]["containers"])


def is_workload(doc: dict[str, Any]) -> bool:
    return "template" in doc.get("spec", {})


def workload(name: str) -> dict[str, Any]:
    [doc] = [doc for doc in kubernetes_documents() if doc["metadata"]["name"] == name and is_workload(doc)]
    return doc


@pytest.mark.parametrize("source", ["compose.yaml", "ops/kubernetes"])
def test_every_sits_variable_of_the_deployment_files_is_a_real_setting(source: str) -> None:
    variables = compose_variables() if source == "compose.yaml" else kubernetes_variables()
    defaults = load_settings(environ={})

    assert "SITS_REDIS_URL" in variables and "SITS_API__HOST" in variables
    for name, value in variables.items():
        settings = load_settings(environ={name: value})  # an unknown SECTION__KEY or a bad value: ConfigError
        changes_a_setting = settings != defaults or "__" in name
        assert changes_a_setting or name in PROCESS_VARIABLES, f"{source}: {name} is no setting SITS reads"
    assert load_settings(environ=variables).api.host == "0.0.0.0"  # the API listens beyond its pod/container


def test_the_process_variables_the_test_allows_are_read_by_the_code() -> None:
    sources = "\n".join(path.read_text() for package in ("broker", "sits_api", "sits_worker")
                        for path in (ROOT / package).rglob("*.py"))

    assert all(f'"{name}"' in sources for name in PROCESS_VARIABLES)


def test_the_kustomization_lists_every_manifest_and_only_files_that_exist() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())

    assert all((KUBERNETES / resource).is_file() for resource in kustomization["resources"])
    assert set(kustomization["resources"]) == {path.name for path in KUBERNETES.glob("*.yaml")} - {
        "kustomization.yaml"}
    images = {container["image"] for doc in kubernetes_documents() for container in containers(doc)}
    assert {image["name"] for image in kustomization["images"]} >= images - {"redis:7"}


def test_workloads_select_their_own_pods_and_services_reach_them() -> None:
    docs = kubernetes_documents()
    pod_labels = [doc["spec"]["template"]["metadata"]["labels"] for doc in docs if is_workload(doc)]
    for doc in docs:
        if is_workload(doc):
            assert doc["spec"]["selector"]["matchLabels"].items() <= doc["spec"]["template"]["metadata"][
                "labels"].items(), doc["metadata"]["name"]
        if doc["kind"] == "Service":
            assert any(doc["spec"]["selector"].items() <= labels.items() for labels in pod_labels), doc
    claimed = {volume["persistentVolumeClaim"]["claimName"] for doc in docs if is_workload(doc)
               for volume in doc["spec"]["template"]["spec"].get("volumes", []) if "persistentVolumeClaim" in volume}
    claims = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "PersistentVolumeClaim"}
    assert claimed == {"sits-data"} and claims["sits-data"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_api_is_probed_on_readyz_and_healthz_and_runs_gunicorn_as_compose_does() -> None:
    [api] = containers(workload("sits-api"))
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())

    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert api["command"] == compose["services"]["api"]["entrypoint"]
    # an annotation-driven scrape sends no key: every pod would answer it 401
    assert "prometheus.io/scrape" not in workload("sits-api")["spec"]["template"]["metadata"].get("annotations", {})


def test_kubernetes_runs_the_processes_compose_runs_with_the_same_commands() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    in_compose = {tuple(service["entrypoint"]) for service in compose["services"].values() if "entrypoint" in service}
    in_kubernetes = {tuple(container["command"]) for doc in kubernetes_documents() for container in containers(doc)
                     if container["image"] in ("sits", "sits-gpu")}

    assert in_kubernetes == in_compose


def test_a_gpu_worker_asks_for_one_gpu_and_a_cpu_worker_for_none() -> None:
    [gpu_worker] = containers(workload("sits-worker-gpu"))
    [cpu_worker] = containers(workload("sits-worker-cpu"))

    assert gpu_worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu_worker["command"][:4] == ["sitsctl", "worker", "--gpu", "0"]
    assert cpu_worker["command"][:3] == ["sitsctl", "worker", "--cpu"]
    assert "nvidia.com/gpu" not in cpu_worker["resources"].get("limits", {})


def test_redis_on_kubernetes_has_the_settings_of_ops_redis_conf_and_keeps_its_aof() -> None:
    def settings(text: str) -> list[str]:
        return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]

    [config_map] = [doc for doc in kubernetes_documents() if doc["metadata"]["name"] == "redis-conf"]
    redis = workload("redis")

    assert settings(config_map["data"]["redis.conf"]) == settings((ROOT / "ops" / "redis" / "redis.conf").read_text())
    assert "appendonly yes" in settings(config_map["data"]["redis.conf"])
    assert redis["kind"] == "StatefulSet" and redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"name": "data", "mountPath": "/data"} in containers(redis)[0]["volumeMounts"]


def test_prometheus_scrapes_the_api_with_a_key_and_flower() -> None:
    config = yaml.safe_load((ROOT / "ops" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())

    assert jobs["sits"]["metrics_path"] == "/metrics" and jobs["sits"]["static_configs"][0]["targets"] == ["api:8470"]
    assert jobs["sits"]["authorization"]["type"] == "Bearer"
    key_file = Path(jobs["sits"]["authorization"]["credentials_file"])
    mounts = dict(volume.split(":")[:2] for volume in compose["services"]["prometheus"]["volumes"])
    assert mounts["./ops/prometheus"] == str(key_file.parent)  # the key file is in the folder compose mounts
    assert f"/ops/prometheus/{key_file.name}" in (ROOT / ".gitignore").read_text().splitlines()
    assert jobs["flower"]["static_configs"][0]["targets"] == ["flower:5555"]


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard_folder() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    mounts = dict(volume.split(":")[:2] for volume in compose["services"]["grafana"]["volumes"])
    datasources = yaml.safe_load((ROOT / "ops/grafana/provisioning/datasources/prometheus.yml").read_text())
    providers = yaml.safe_load((ROOT / "ops/grafana/provisioning/dashboards/sits.yml").read_text())

    assert mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./ops/grafana/dashboards"] == providers["providers"][0]["options"]["path"]
    [prometheus] = datasources["datasources"]
    assert prometheus["uid"] == "prometheus" and prometheus["url"] == "http://prometheus:9090"
    assert (ROOT / "ops/grafana/dashboards/sits.json").read_text().count('"uid": "prometheus"') > 10


def interpolated(value: str) -> str:
    """A compose value as compose reads it with no variable set: `${NAME:-default}` becomes the default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_compose_locks_redis_and_flower_and_binds_the_dashboards_to_loopback() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]

    assert "--requirepass" in services["redis"]["command"]
    assert "${SITS_REDIS_PASSWORD:?" in services["redis"]["command"][-1]  # no default: compose refuses to start
    for service in (compose["x-sits"], services["flower"]):
        assert service["environment"]["SITS_REDIS_URL"].startswith("redis://:${SITS_REDIS_PASSWORD:?")
    assert ":${SITS_FLOWER_PASSWORD:?" in services["flower"]["environment"]["FLOWER_BASIC_AUTH"]
    for name in ("flower", "prometheus", "grafana"):
        assert all(interpolated(port).startswith("127.0.0.1:") for port in services[name]["ports"]), name
    flower_job = {job["job_name"]: job for job in yaml.safe_load(
        (ROOT / "ops" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]}["flower"]
    assert Path(flower_job["basic_auth"]["password_file"]).name == "flower-password"
    assert "/ops/prometheus/flower-password" in (ROOT / ".gitignore").read_text().splitlines()


def test_compose_restarts_and_probes_every_service_and_runs_a_gpu_worker_behind_its_profile() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]  # (the YAML merge key `<<: *sits` already merged in)

    for name, service in services.items():
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"], name
    assert services["worker"]["healthcheck"]["test"] == ["CMD", "python", "-m", "sits_worker.upkeep.liveness"]
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["build"]["args"]["ORT_EXTRA"] == "gpu"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert gpu["entrypoint"] == containers(workload("sits-worker-gpu"))[0]["command"]


def test_the_image_runs_as_a_user_of_its_own_and_its_build_context_leaves_secrets_and_data_out() -> None:
    dockerfile = (ROOT / "ops" / "docker" / "Dockerfile").read_text().splitlines()
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}

    users = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert {".venv", "data", ".env", ".git", "ops/prometheus/sits-api-key", "ops/prometheus/flower-password"} <= ignored


def test_redis_on_kubernetes_requires_the_secret_s_password_and_every_sits_pod_carries_it() -> None:
    def env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {entry["name"]: entry for entry in container.get("env", [])}

    secret = {"secretKeyRef": {"name": "sits-redis", "key": "password"}}
    [redis] = containers(workload("redis"))
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert env(redis)["REDIS_PASSWORD"]["valueFrom"] == secret == env(redis)["REDISCLI_AUTH"]["valueFrom"]
    sits_pods = [container for doc in kubernetes_documents() for container in containers(doc)
                 if container["image"] in ("sits", "sits-gpu")]
    assert len(sits_pods) >= 4  # the API, both workers and Flower
    for container in sits_pods:
        variables = env(container)
        names = list(variables)
        # Kubernetes expands $(REDIS_PASSWORD) only from a variable defined before it
        assert names.index("REDIS_PASSWORD") < names.index("SITS_REDIS_URL"), container["name"]
        assert variables["REDIS_PASSWORD"]["valueFrom"] == secret
        assert variables["SITS_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@redis:6379/0"
    config_maps = [doc for doc in kubernetes_documents() if doc["kind"] == "ConfigMap"]
    assert not any("SITS_REDIS_URL" in doc["data"] for doc in config_maps), "a URL without the password"
