"""The security context of every container the operator renders (workers and router).

    pod        runAsNonRoot, runAsUser/runAsGroup/fsGroup = podSecurity.runAsUser (10001, the images' USER),
               seccomp RuntimeDefault; fsGroup makes the 0400 secret volumes readable (the kubelet
               gives them the pod's group: 0440 root:<fsGroup>), OnRootMismatch keeps it from
               walking a checkpoint volume on every start
    container  no privilege escalation, every capability dropped except the ones RDMA needs
               (spec.rdma.capabilities, IPC_LOCK, only when kvTransfer.protocol is rdma),
               read-only root filesystem with a writable emptyDir at /tmp (HOME=/tmp, so caches
               such as ~/.cache/huggingface and ~/.triton land there)

`podSecurity.runAsUser: 0` runs as root (runAsNonRoot off): needed when the memlock limit of the
nodes is too low for RDMA registration, since Kubernetes gives a non-root process no effective
capabilities from `capabilities.add` (it has no ambient capabilities).
"""
from __future__ import annotations

from typing import Any

from deepseek_pd.operator.spec import DeploymentSpec

TMP_VOLUME = "tmp"
TMP_DIR = "/tmp"


def pod_security_context(spec: DeploymentSpec) -> dict[str, Any]:
    uid = spec.pod_security.run_as_user
    context: dict[str, Any] = {"runAsNonRoot": uid != 0, "seccompProfile": {"type": "RuntimeDefault"}}
    if uid:
        context.update(runAsUser=uid, runAsGroup=uid, fsGroup=uid, fsGroupChangePolicy="OnRootMismatch")
    return context


def container_security_context(spec: DeploymentSpec, capabilities: tuple[str, ...] = ()) -> dict[str, Any]:
    """`capabilities`: the ones this container needs back after dropping ALL."""
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if capabilities:
        caps["add"] = list(capabilities)
    return {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": caps,
            "readOnlyRootFilesystem": spec.pod_security.read_only_root_filesystem}


def worker_capabilities(spec: DeploymentSpec) -> tuple[str, ...]:
    return tuple(spec.rdma.capabilities) if spec.rdma_enabled else ()


def writable_tmp(spec: DeploymentSpec) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, volumeMounts, env) of the writable /tmp; nothing with a writable root filesystem."""
    if not spec.pod_security.read_only_root_filesystem:
        return [], [], []
    return ([{"name": TMP_VOLUME, "emptyDir": {}}],
            [{"name": TMP_VOLUME, "mountPath": TMP_DIR}],
            [{"name": "HOME", "value": TMP_DIR}])


def secure_container(spec: DeploymentSpec, pod_spec: dict[str, Any], container: dict[str, Any],
                     capabilities: tuple[str, ...] = ()) -> None:
    """Adds the pod and container security contexts and the writable /tmp to a rendered pod
    (in place: it runs on a pod spec a builder has just made, never on a shared one)."""
    pod_spec["securityContext"] = pod_security_context(spec)
    container["securityContext"] = container_security_context(spec, capabilities)
    volumes, mounts, env = writable_tmp(spec)
    if volumes:
        pod_spec["volumes"] = [*pod_spec.get("volumes", []), *volumes]
        container["volumeMounts"] = [*container.get("volumeMounts", []), *mounts]
        have = {e["name"] for e in container.get("env", [])}  # a user's HOME wins
        container["env"] = [*container.get("env", []), *(e for e in env if e["name"] not in have)]
    # Helpers (init containers such as a weights download) get the same context, no capabilities.
    for other in [*pod_spec["containers"], *pod_spec.get("initContainers", [])]:
        if other is not container and "securityContext" not in other:
            other["securityContext"] = container_security_context(spec)
            other["volumeMounts"] = [*other.get("volumeMounts", []), *mounts]
