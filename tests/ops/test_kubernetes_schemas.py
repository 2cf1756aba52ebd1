"""The Kubernetes manifests are valid resources: the built-in kinds against Kubernetes' own schemas
(kubernetes-validate, strict: no unknown field), the KEDA ScaledObjects against KEDA's CRD schema (its
`openAPIV3Schema`, vendored in tests/ops/schemas/), and they scale what exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "ops" / "kubernetes"
KEDA_CRD = Path(__file__).parent / "schemas" / "keda.sh_scaledobjects.yaml"


def documents(folder: Path) -> list[dict[str, Any]]:
    return [doc for path in sorted(folder.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_every_built_in_resource_validates_strictly_against_kubernetes_schemas() -> None:
    docs = documents(KUBERNETES)
    assert {"Deployment", "StatefulSet", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= {d["kind"] for d in docs}
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_scaled_objects_validate_against_keda_s_crd_and_target_the_worker_deployments() -> None:
    crd = next(doc for doc in yaml.safe_load_all(KEDA_CRD.read_text()) if doc)
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = version["schema"]["openAPIV3Schema"]
    scaled = documents(KUBERNETES / "keda")
    deployments = {doc["metadata"]["name"]: doc for doc in documents(KUBERNETES) if doc["kind"] == "Deployment"}

    assert {doc["metadata"]["name"] for doc in scaled} == {"sits-worker-cpu", "sits-worker-gpu"}
    for doc in scaled:
        jsonschema.validate(doc, schema)
        assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
        target = deployments[doc["spec"]["scaleTargetRef"]["name"]]
        assert target["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
        [trigger] = doc["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and "sits_queue_waiting_items" in trigger["metadata"]["query"]
    with pytest.raises(jsonschema.ValidationError):  # (the schema is checked, not merely read)
        jsonschema.validate(scaled[0] | {"spec": {"triggers": "none"}}, schema)


def test_workers_are_probed_by_their_heartbeat_and_budgets_cover_every_scaled_deployment() -> None:
    docs = documents(KUBERNETES)
    probe = ["python", "-m", "sits_worker.upkeep.liveness"]
    for name in ("sits-worker-cpu", "sits-worker-gpu"):
        [deployment] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert container["livenessProbe"]["exec"]["command"] == container["readinessProbe"]["exec"]["command"] == probe
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] for d in docs
               if d["kind"] == "PodDisruptionBudget"}
    assert budgets == {"sits-api", "sits-worker-cpu", "sits-worker-gpu"}
    [hpa] = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "sits-api"
