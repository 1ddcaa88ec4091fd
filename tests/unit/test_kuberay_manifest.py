"""deployments/kuberay/rayservice.yaml: a KubeRay RayService (ray.io/v1) on a CPU-only Ray 2.60.0 / Python 3.11
image, whose serveConfigV2 is serve_config.cluster.yaml and whose worker pods fit that config's replicas, and the
ReadWriteMany volume every pod mounts as the Batch API's directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deployments" / "kuberay"
RAY_IMAGE = "rayproject/ray:2.60.0-py311-cpu"


def documents() -> dict[str, dict[str, Any]]:
    """The file's documents by kind: the RayService and the Batch API's volume claim."""
    loaded = list(yaml.safe_load_all((KUBERAY / "rayservice.yaml").read_text()))
    by_kind = {document["kind"]: document for document in loaded}
    assert len(by_kind) == len(loaded) == 2, sorted(by_kind)
    return by_kind


def manifest() -> dict[str, Any]:
    return documents()["RayService"]


def pod_specs(cluster: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield cluster["headGroupSpec"]["template"]["spec"]
    for group in cluster["workerGroupSpecs"]:
        yield group["template"]["spec"]


def test_manifest_is_a_rayservice_with_head_and_worker_groups() -> None:
    document = manifest()
    assert document["apiVersion"] == "ray.io/v1" and document["kind"] == "RayService"
    cluster = document["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["headGroupSpec"]["rayStartParams"] and cluster["headGroupSpec"]["template"]["spec"]["containers"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]


def test_embedded_serve_config_is_the_shipped_cluster_config() -> None:
    embedded = manifest()["spec"]["serveConfigV2"]
    assert yaml.safe_load(embedded) == yaml.safe_load((ROOT / "serve_config.cluster.yaml").read_text())


def test_every_pod_runs_the_cpu_only_image_built_on_ray_2_60_py311() -> None:
    images = set()
    for spec in pod_specs(manifest()["spec"]["rayClusterConfig"]):
        for container in spec["containers"]:
            images.add(container["image"])
            resources = container.get("resources", {})
            assert not any("gpu" in name for part in resources.values() for name in part), container["name"]
    (image,) = images
    assert image.endswith("ray2.60.0-py311-cpu")
    from_lines = [line for line in (KUBERAY / "Dockerfile").read_text().splitlines() if line.startswith("FROM ")]
    assert from_lines == [f"FROM {RAY_IMAGE}"]


def test_worker_pods_fit_the_model_replicas_and_mount_the_keys_file() -> None:
    document = manifest()
    serve_config = yaml.safe_load(document["spec"]["serveConfigV2"])
    (application,) = serve_config["applications"]
    (model,) = application["args"]["models"]
    (workers,) = document["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    # One model replica per worker pod: the pods Ray may start are the replicas Serve may ask for.
    assert float(workers["rayStartParams"]["num-cpus"]) == model["ray_actor_options"]["num_cpus"]
    assert workers["minReplicas"] == model["autoscaling"]["min_replicas"]
    assert workers["maxReplicas"] == model["autoscaling"]["max_replicas"]
    keys_dir = str(Path(application["runtime_env"]["env_vars"]["EMBEDDINGS_API_KEYS_FILE"]).parent)
    for spec in pod_specs(document["spec"]["rayClusterConfig"]):
        (container,) = spec["containers"]
        assert keys_dir in {mount["mountPath"] for mount in container["volumeMounts"]}


def test_every_pod_mounts_one_read_write_many_volume_as_the_batch_directory() -> None:
    claim = documents()["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every node's ingress reads and writes it
    (application,) = yaml.safe_load(manifest()["spec"]["serveConfigV2"])["applications"]
    directory = application["args"]["batch"]["directory"]
    for spec in pod_specs(manifest()["spec"]["rayClusterConfig"]):
        (container,) = spec["containers"]
        (volume,) = [mount["name"] for mount in container["volumeMounts"] if mount["mountPath"] == directory]
        (source,) = [v for v in spec["volumes"] if v["name"] == volume]
        assert source["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
