"""Pure builders for the worker children of one role: ConfigMap, per-group StatefulSet and Service.

A group is one model replica spread over `size` pods; the StatefulSet's pod index is the rank.
Pods get the LeaderWorkerSet env names (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX) so
images written for LWS work unchanged, plus DEEPSEEK_PD_* names for our own worker.

The StatefulSet uses `updateStrategy: OnDelete`: the operator, not the StatefulSet controller,
decides when a group's pods are replaced, so a group always restarts as a whole.
"""
from __future__ import annotations

import json
import math
from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.build_model import model_pod_parts
from deepseek_pd.operator.build_eplb import eplb_pod_parts
from deepseek_pd.operator.build_metrics import scrape_annotations, worker_metrics_port, worker_metrics_ports
from deepseek_pd.operator.pod_placement import place_group_pods
from deepseek_pd.operator.spec import DeploymentSpec, RoleSpec
from deepseek_pd.operator.worker_security import prefill_peers, secure_worker_pod
from deepseek_pd.workers.serve.flags import ParallelFlags, ServeFlags

Manifest = dict[str, Any]
POD_DNS_NAME_ENV = "DEEPSEEK_PD_POD_DNS_NAME"
POD_IP_ENV = "DEEPSEEK_PD_POD_IP"

DIST_INIT_PORT = 5757  # torch.distributed rendezvous on rank 0 of a multi-node group
PROBE_PERIOD_SECONDS = 10
# A worker pod's termination grace: at least MIN_GRACE_SECONDS, and always the worker's own
# shutdown bound, so the kubelet's SIGKILL never cuts a drain short (a scale-down's running
# streams finish): --drain-timeout (engineArgs, default 30 s), then the gRPC server's stop grace
# (workers/api/server.py, 2 s) and the group's (workers/serve/group_main.py STOP_GRACE_S, 10 s),
# and time to exit; SHUTDOWN_MARGIN_SECONDS covers all but the drain.
MIN_GRACE_SECONDS = 60
SHUTDOWN_MARGIN_SECONDS = 20
# Rank 0 serves gRPC; other ranks only run model shards, so they count as ready while alive.
_PORT_PROBE = ("import os, socket, sys\n"
               "if os.environ.get('LWS_WORKER_INDEX', '0') == '0':\n"
               "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2).close()\n")


def build_worker_config(spec: DeploymentSpec, role: RoleSpec) -> dict[str, Any]:
    """The rendered worker configuration, mounted at /etc/deepseek-pd/worker.json."""
    return {
        "role": role.role,
        "model": spec.model.path,
        "servedName": spec.model.served_name,
        "port": role.port,
        "bootstrapPort": role.bootstrap_port if role.role == "prefill" else None,
        "groupSize": role.size,
        "gpusPerPod": role.gpus_per_pod,
        "parallelism": {"tp": role.parallelism.tp, "dp": role.parallelism.dp,
                        "ep": role.parallelism.ep},
        "deepepMode": role.deepep_mode,
        "kvTransfer": {"backend": spec.kv_transfer.backend, "protocol": spec.kv_transfer.protocol,
                       "devices": list(spec.kv_transfer.devices),
                       "tcpFallback": spec.kv_transfer.tcp_fallback},
        "engineArgs": list(role.engine_args),
    }


def build_worker_configmap(spec: DeploymentSpec, role: RoleSpec) -> Manifest:
    config = build_worker_config(spec, role)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names.config_map_name(spec.name, role.role),
            "namespace": spec.namespace,
            "labels": {**names.base_labels(spec.name, role.role), names.LABEL_ROLE: role.role},
        },
        "data": {names.WORKER_CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)},
    }


# What the operator always spells out, defaults included (the image's defaults may differ from
# this operator's): what the router, the probes and the other workers are told.
_ALWAYS = ("model", "served_model_name", "host", "port", "kv_transport", "device")


def worker_serve_flags(spec: DeploymentSpec, role: RoleSpec) -> ServeFlags:
    """The `deepseek-pd serve` flags the operator manages (workers/serve/flags.py `managed`); values
    of the form $(VAR) are expanded by the kubelet from the pod env."""
    # Peers reach this pod at its IP: Mooncake's session id, a follower rank's engine and bootstrap
    # endpoints, decode's identity. Rendered from the kubelet's status.podIP (the node's IP with
    # host networking) rather than left to `serve` resolving the hostname, which a pod's
    # /etc/hosts may not map.
    prefill = role.role == "prefill"
    par = role.parallelism
    kv = spec.kv_transfer
    mooncake = kv.backend == "mooncake"  # kvTransfer.protocol/devices/tcpFallback configure Mooncake only
    return ServeFlags(
        role=role.role, model=spec.model.path, served_model_name=spec.model.served_name, host="0.0.0.0",
        advertise_host=f"$({POD_IP_ENV})", port=role.port, kv_transport=kv.backend,
        device="cuda" if role.gpus_per_pod else "cpu",
        # The router hands decode this pod's DNS name (names.leader_address), which decode then
        # names in its signed handshake: the bootstrap service answers to it as well as to the
        # pod IP it advertises (the address followers' bootstrap endpoints are published at).
        bootstrap_port=role.bootstrap_port if prefill else ServeFlags.bootstrap_port,
        bootstrap_aliases=(f"$({POD_DNS_NAME_ENV})",) if prefill else (),
        kv_protocol=kv.protocol if mooncake else ServeFlags.kv_protocol,
        kv_devices=",".join(kv.devices) if mooncake else "", kv_tcp_fallback=mooncake and kv.tcp_fallback,
        metrics_port=worker_metrics_port(spec),
        parallel=ParallelFlags(
            tp=par.tp, dp=par.dp, ep=par.ep,
            deepep_mode=role.deepep_mode if par.ep > 1 else ParallelFlags.deepep_mode, nnodes=role.size,
            dist_init_addr=f"$(LWS_LEADER_ADDRESS):{DIST_INIT_PORT}" if role.size > 1 else "",
            init_expert_location=eplb_pod_parts(role).location),
        prefill_peers=prefill_peers(spec, role),
        # decode.speculative: prefill runs the MTP layer over prompts and sends its KV, so both roles
        # take it (workers refuse a peer that disagrees).
        speculative_num_steps=spec.speculative_num_steps)


def build_worker_args(spec: DeploymentSpec, role: RoleSpec) -> list[str]:
    """`deepseek-pd serve <role>` argv: the managed flags, then the role's engineArgs."""
    flags = worker_serve_flags(spec, role)
    always = (_ALWAYS + (("bootstrap_port",) if role.role == "prefill" else ())
              + (("kv_protocol",) if spec.kv_transfer.backend == "mooncake" else ()))
    rank = {"node_rank": "$(LWS_WORKER_INDEX)"} if role.size > 1 else {}
    return ["serve", *flags.to_argv(always=always, text=rank), *role.engine_args]


def termination_grace_seconds(role: RoleSpec) -> int:
    """The pod's terminationGracePeriodSeconds: the worker's drain (its --drain-timeout, as the
    worker parses engineArgs) plus its stop margins, never under MIN_GRACE_SECONDS."""
    try:
        drain = ServeFlags.from_argv([role.role, *role.engine_args]).drain_timeout_s
    except ValueError:  # engineArgs the worker refuses: the memory plan reports them
        drain = ServeFlags.drain_timeout_s
    return max(MIN_GRACE_SECONDS, math.ceil(drain) + SHUTDOWN_MARGIN_SECONDS)


def _env(spec: DeploymentSpec, role: RoleSpec, index: int) -> list[dict[str, Any]]:
    leader = names.leader_address(spec.name, role.role, index, spec.namespace)
    pod_index = {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{names.LABEL_POD_INDEX}']"}}}
    env = [
        {"name": "LWS_LEADER_ADDRESS", "value": leader},
        {"name": "LWS_GROUP_SIZE", "value": str(role.size)},
        {"name": "LWS_WORKER_INDEX", **pod_index},
        {"name": "DEEPSEEK_PD_ROLE", "value": role.role},
        {"name": "DEEPSEEK_PD_GROUP_INDEX", "value": str(index)},
        {"name": "DEEPSEEK_PD_WORKER_CONFIG",
         "value": f"{names.WORKER_CONFIG_DIR}/{names.WORKER_CONFIG_FILE}"},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "DEEPSEEK_PD_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # This pod through its group's headless Service (the StatefulSet's serviceName).
        {"name": POD_DNS_NAME_ENV, "value": f"$(DEEPSEEK_PD_POD_NAME).{names.group_name(spec.name, role.role, index)}"
                                           f".{spec.namespace}.svc"},
    ]
    if spec.kv_transfer.backend == "mooncake":
        # Mooncake reads MC_FORCE_TCP itself; it agrees with --kv-protocol (a TCP fallback needs no
        # override). Users add MC_GID_INDEX etc. through spec.env.
        env.append({"name": "MC_FORCE_TCP", "value": "false" if spec.rdma_enabled else "true"})
    return env + [dict(e) for e in spec.env] + [dict(e) for e in role.env]


def _resources(spec: DeploymentSpec, role: RoleSpec) -> dict[str, Any]:
    limits = dict(role.resources.get("limits", {}))
    requests = dict(role.resources.get("requests", {}))
    if role.gpus_per_pod:
        limits["nvidia.com/gpu"] = requests["nvidia.com/gpu"] = str(role.gpus_per_pod)
    if spec.rdma_enabled and spec.rdma.resource_name:
        rdma_count = str(spec.rdma.resources_per_pod)
        limits[spec.rdma.resource_name] = requests[spec.rdma.resource_name] = rdma_count
    out = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _probe(role: RoleSpec, failure_threshold: int) -> dict[str, Any]:
    return {
        "exec": {"command": ["python3", "-c", _PORT_PROBE, str(role.port)]},
        "periodSeconds": PROBE_PERIOD_SECONDS,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }


def _ports(spec: DeploymentSpec, role: RoleSpec) -> list[dict[str, Any]]:
    ports = [{"name": "grpc", "containerPort": role.port, "protocol": "TCP"},
             {"name": "dist-init", "containerPort": DIST_INIT_PORT, "protocol": "TCP"}]
    if role.role == "prefill":
        ports.append({"name": "bootstrap", "containerPort": role.bootstrap_port, "protocol": "TCP"})
    return ports + worker_metrics_ports(spec, role)


def build_pod_template(spec: DeploymentSpec, role: RoleSpec, index: int, revision: str) -> Manifest:
    """The pod template of group `index`: worker container, probes, volumes, scheduling."""
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["deepseek-pd"],
        "args": build_worker_args(spec, role),
        "env": _env(spec, role, index),
        "ports": _ports(spec, role),
        "resources": _resources(spec, role),
        "startupProbe": _probe(role, math.ceil(role.startup_timeout_seconds / PROBE_PERIOD_SECONDS)),
        "readinessProbe": _probe(role, 3),
        "livenessProbe": _probe(role, 6),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "worker-config", "mountPath": names.WORKER_CONFIG_DIR, "readOnly": True}],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shared_memory_size}},
        {"name": "worker-config", "configMap": {"name": names.config_map_name(spec.name, role.role)}},
    ]
    model = model_pod_parts(spec, role)  # the model volume and its download/check init container
    eplb = eplb_pod_parts(role)  # the role's static expert placement, if it names one
    volumes += model.volumes + eplb.volumes
    container["volumeMounts"] += model.worker_mounts + eplb.mounts
    pod_spec: dict[str, Any] = {
        "initContainers": model.init_containers,
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": termination_grace_seconds(role),
        "enableServiceLinks": False,
    }
    scheduling = spec.scheduling
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        if scheduling.get(key):
            pod_spec[key] = scheduling[key]
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    if spec.rdma_enabled and spec.rdma.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    secure_worker_pod(spec, pod_spec)  # secret, decode's prefill allowlist, securityContext
    annotations = {names.ANNOTATION_REVISION: revision, **scrape_annotations(spec, spec.metrics.port)}
    if role.role == "prefill":
        annotations[names.ANNOTATION_BOOTSTRAP_PORT] = str(role.bootstrap_port)
    labels = {**names.base_labels(spec.name, role.role),
              **names.group_selector(spec.name, role.role, index), names.LABEL_REVISION: revision}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}


def build_group_statefulset(spec: DeploymentSpec, role_name: str, index: int) -> Manifest:
    role = spec.role(role_name)
    revision = spec.role_revision(role_name)
    group = names.group_name(spec.name, role_name, index)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": group,
            "namespace": spec.namespace,
            "labels": {**names.base_labels(spec.name, role_name),
                       **names.group_selector(spec.name, role_name, index), names.LABEL_REVISION: revision},
            "annotations": {names.ANNOTATION_REVISION: revision},
        },
        "spec": {
            "serviceName": group,
            "replicas": role.size,
            "podManagementPolicy": "Parallel",  # ranks rendezvous with each other; start them together
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": names.group_selector(spec.name, role_name, index)},
            "template": place_group_pods(spec, role_name, index, build_pod_template(spec, role, index, revision)),
        },
    }


def build_group_service(spec: DeploymentSpec, role_name: str, index: int) -> Manifest:
    """Headless, publishing not-ready pods: ranks must resolve the leader before it is Ready."""
    role = spec.role(role_name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": names.group_name(spec.name, role_name, index),
            "namespace": spec.namespace,
            "labels": {**names.base_labels(spec.name, role_name),
                       **names.group_selector(spec.name, role_name, index)},
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.group_selector(spec.name, role_name, index),
            "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["containerPort"],
                       "protocol": "TCP"} for p in _ports(spec, role)],
        },
    }
