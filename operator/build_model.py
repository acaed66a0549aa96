"""Pure builders for getting the model into a worker pod: the download init container, the model
volumes and mounts, and the cache claim the operator creates for `model.cache.size`.

Every worker pod runs `deepseek-pd download` as its init container `model` before the worker
starts (one init container per pod rather than one Job per deployment; docs/operations.md
"Model download" says why):

    huggingFace  downloads layout.snapshot_dir(/model-cache, id, revision) into the cache volume,
                 resumable and verified; on a shared volume (a ReadWriteMany claim, a hostPath)
                 the first pod downloads and the others wait on its per-file locks, then verify.
    pvc/hostPath checks the checkpoint directory in place (config.json + weights), so a wrong
                 model.path fails here with ModelNotFound instead of in every rank's loader.

A failure exits with a reason's code and writes "<Reason>: <message>" to the termination log;
`terminationMessagePolicy: FallbackToLogsOnError` makes the kubelet keep the log's tail when the
process died before writing it. operator/model_status.py reads it back into `ModelReady`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec, HubModel, RoleSpec

Manifest = dict[str, Any]

INIT_CONTAINER = "model"  # the init container's name; model_status.py finds it by this name
TERMINATION_LOG = "/dev/termination-log"  # the kubelet's default terminationMessagePath
CACHE_VOLUME = "model-cache"
MODEL_VOLUME = "model"
# huggingface_hub keeps small state (token, xet cache) under HF_HOME; the root filesystem may be
# read-only, so it lives in the cache volume, beside (never inside) the snapshots.
HF_HOME = f"{names.MODEL_CACHE_MOUNT}/.hf-home"


@dataclass(frozen=True)
class ModelPodParts:
    """What the model adds to a worker pod template."""

    volumes: list[dict[str, Any]] = field(default_factory=list)
    worker_mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def hub_env(hub: HubModel) -> list[dict[str, Any]]:
    """HF_TOKEN from the user's Secret and HF_ENDPOINT for a mirror: for the download and the router."""
    env: list[dict[str, Any]] = []
    if hub.token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": hub.token_secret, "key": hub.token_key}}})
    if hub.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": hub.endpoint})
    return env


def cache_volume_source(spec: DeploymentSpec) -> dict[str, Any]:
    """model.cache as a core volume source (claim, created claim, hostPath, or emptyDir)."""
    cache = spec.model.cache
    if cache.claim_name:
        return {"persistentVolumeClaim": {"claimName": cache.claim_name}}
    if cache.size:
        return {"persistentVolumeClaim": {"claimName": names.model_cache_claim_name(spec.name)}}
    if cache.host_path:
        return {"hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    return {"emptyDir": {"sizeLimit": cache.size_limit}}


def build_model_cache_claim(spec: DeploymentSpec) -> Manifest | None:
    """The PVC for model.cache.size (None otherwise). Owned by the deployment like every child,
    so deleting the deployment deletes the downloaded weights; an existing claimName is kept."""
    cache = spec.model.cache
    if spec.model.hub is None or not cache.size:
        return None
    claim_spec: dict[str, Any] = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": cache.size}},
        "volumeMode": "Filesystem",
    }
    if cache.storage_class:
        claim_spec["storageClassName"] = cache.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": names.model_cache_claim_name(spec.name), "namespace": spec.namespace,
                     "labels": names.base_labels(spec.name, "model-cache")},
        "spec": claim_spec,
    }


def download_args(spec: DeploymentSpec) -> list[str]:
    """`deepseek-pd download` arguments of the init container; the directory it makes ready is
    the worker's `--model` (spec.model.path)."""
    hub = spec.model.hub
    if hub is not None:
        args = ["download", "--source", "huggingFace", "--repo", hub.repo, "--revision", hub.revision,
                "--cache-dir", names.MODEL_CACHE_MOUNT]
    else:
        source = "pvc" if "persistentVolumeClaim" in (spec.model.volume or {}) else "hostPath"
        args = ["download", "--source", source, "--path", spec.model.path]
    return args + ["--termination-log", TERMINATION_LOG]


def build_model_init_container(spec: DeploymentSpec, role: RoleSpec) -> dict[str, Any]:
    hub = spec.model.hub
    env: list[dict[str, Any]] = []
    if hub is not None:
        env = [*hub_env(hub), {"name": "HF_HOME", "value": HF_HOME},
               {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    mount = ({"name": CACHE_VOLUME, "mountPath": names.MODEL_CACHE_MOUNT} if hub is not None else
             {"name": MODEL_VOLUME, "mountPath": names.MODEL_MOUNT, "readOnly": True})
    return {
        "name": INIT_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["deepseek-pd"],
        "args": download_args(spec),
        # The user's env comes last, as in the worker: proxies (HTTPS_PROXY) reach the download.
        "env": env + [dict(e) for e in spec.env] + [dict(e) for e in role.env],
        "volumeMounts": [mount],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def model_pod_parts(spec: DeploymentSpec, role: RoleSpec) -> ModelPodParts:
    """The model volume (read-only in the worker), and the init container that makes it ready."""
    if spec.model.hub is not None:
        volume = {"name": CACHE_VOLUME, **cache_volume_source(spec)}
        mount = {"name": CACHE_VOLUME, "mountPath": names.MODEL_CACHE_MOUNT, "readOnly": True}
    else:
        assert spec.model.volume is not None  # pvc or hostPath (ModelSpec.parse)
        volume = {"name": MODEL_VOLUME, **spec.model.volume}
        mount = {"name": MODEL_VOLUME, "mountPath": names.MODEL_MOUNT, "readOnly": True}
    return ModelPodParts([volume], [mount], [build_model_init_container(spec, role)])
