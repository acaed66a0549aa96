"""Rendered pods (pdtest.rendered_pods) as commands for this machine: what a node would provide.

Each container's env is resolved and its `$(VAR)`s expanded exactly as the kubelet does
(pdtest.pod_inputs, fieldRefs from the pod object: pod-index label, metadata.name, podIP). Then
these substitutions, and no others, stand in for a cluster:

    addresses   `HOST:PORT` in an argument, whose HOST is a pod's DNS name (`<pod>.<svc>.<ns>.svc`), a group-index
                pattern of such names (`*` = digits) or a Service's name (every pod it selects) ->
                `127.0.0.1:LOCAL`. LOCAL is a free port standing for that pod's containerPort PORT
                (all pods share one network here). A name standing for several pods becomes all
                their addresses, comma-joined (only lists, like --prefill-peers, hold such names).
                A name no rendered object provides, or a port its pod does not declare, fails.
    listening   the value of a `--*-port` flag must be one of the pod's containerPorts -> its LOCAL;
                the router's `--prefill URL BOOTSTRAP_PORT` -> the URL's pod's LOCAL for that port.
    paths       an argument or env value under a volumeMount's mountPath -> where that volume is
                here (pod_inputs.prepare_volumes writes configMap/secret files, makes emptyDirs);
                hostPath volumes' node paths come from `host_paths` (the model: a directory with
                the tiny checkpoint under model.path); terminationMessagePath -> a file per container.
    entrypoint  `deepseek-pd` -> this interpreter's `-m deepseek_pd.cli`; `python3` -> this interpreter.
    node        status.podIP 127.0.0.1; OMP_NUM_THREADS=1 (many ranks on few cores).
    stop        a `--shutdown-grace-period-secs` value -> 1: smg keeps its port open min(5 s, half
                the grace) after SIGTERM for a load balancer to notice; here nothing is in front
                and nothing in flight when the pods stop, so that was 5 s idle per stop.

Left out, not substituted: securityContext, resources, probes, the /dev/shm tmpfs, image pulls.
Names given only as names (the prefill's `--bootstrap-alias`, LWS_LEADER_ADDRESS and the other
env values) stay as rendered: nothing here dials them.
"""
from __future__ import annotations

import copy
import os
import pathlib
import re
import sys
from dataclasses import dataclass, field

from deepseek_pd.ports import pick_free_ports
from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec

from pdtest.pod_inputs import Obj, container_env, prepare_volumes
from pdtest.rendered_pods import RenderedDeployment, container_ports, pod_dns_name, selects

LOCALHOST = "127.0.0.1"
_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9*_.-]+\.svc(?:\.cluster\.local)?):(?P<port>\d+)")
_ENTRYPOINTS = {"deepseek-pd": [sys.executable, "-m", "deepseek_pd.cli"], "python3": [sys.executable]}
_NODE_ENV = {"OMP_NUM_THREADS": "1"}
_SHUTDOWN_GRACE = "1"


@dataclass(frozen=True)
class Command:
    name: str  # <pod>/<container>
    argv: list[str]
    env: dict[str, str]  # the container's own variables (the process also inherits this one's)
    cwd: pathlib.Path


@dataclass
class LocalPod:
    pod: Obj
    ports: dict[int, int]  # containerPort -> the local port standing for it
    init: list[Command] = field(default_factory=list)
    main: list[Command] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]


class LocalNetwork:
    """Every (pod, containerPort) of `pods` -> a free local port; cluster names -> 127.0.0.1."""

    def __init__(self, rendered: RenderedDeployment, pods: list[Obj]) -> None:
        self.services = rendered.of_kind("Service")
        self.pods = pods
        wanted = [(pod["metadata"]["name"], port) for pod in pods for port in container_ports(pod)]
        self.local = dict(zip(wanted, pick_free_ports(len(wanted))))

    def ports_of(self, pod: Obj) -> dict[int, int]:
        return {port: self.local[(pod["metadata"]["name"], port)] for port in container_ports(pod)}

    def _targets(self, host: str, port: int) -> list[tuple[Obj, int]]:
        """(pod, containerPort) pairs a cluster `host:port` reaches."""
        host = host.removesuffix(".cluster.local")
        if "*" in host:
            pattern = re.compile("[0-9]+".join(re.escape(part) for part in host.split("*")))
            return [(pod, port) for pod in self.pods if pattern.fullmatch(pod_dns_name(pod) or "")]
        named = [(pod, port) for pod in self.pods if pod_dns_name(pod) == host]
        if named:
            return named
        for service in self.services:
            meta = service["metadata"]
            if host == f"{meta['name']}.{meta['namespace']}.svc":
                target = next((p.get("targetPort", p["port"]) for p in service["spec"]["ports"] if p["port"] == port),
                              None)
                assert isinstance(target, int), f"Service {meta['name']} has no numeric port {port}"
                return [(pod, target) for pod in self.pods if selects(service, pod)]
        return []

    def address(self, host: str, port: int) -> str:
        """`127.0.0.1:LOCAL`[,...] for a cluster address; fails for one nothing rendered provides."""
        targets = self._targets(host, port)
        assert targets, f"{host}:{port} names no rendered pod or Service"
        local = []
        for pod, container_port in targets:
            key = (pod["metadata"]["name"], container_port)
            assert key in self.local, f"{host}:{port}: pod {key[0]} declares no containerPort {container_port}"
            local.append(f"{LOCALHOST}:{self.local[key]}")
        return ",".join(dict.fromkeys(local))

    def rewrite(self, argv: list[str], own_ports: dict[int, int]) -> list[str]:
        out = []
        for i, arg in enumerate(argv):
            previous = argv[i - 1] if i else ""
            if previous.startswith("--") and previous.endswith("-port"):
                assert arg.isdigit() and int(arg) in own_ports, f"{previous} {arg}: not a containerPort of the pod"
                arg = str(own_ports[int(arg)])
            elif i >= 2 and argv[i - 2] == "--prefill" and arg.isdigit():  # the router's bootstrap port
                url = _ADDRESS.search(argv[i - 1])
                arg = self.address(url["host"], int(arg)).rpartition(":")[2]
            out.append(_ADDRESS.sub(lambda m: self.address(m["host"], int(m["port"])), arg))
        return out


def _mount_paths(container: Obj, volumes: dict) -> list[tuple[str, str]]:
    """(mountPath, local path) of the container's file-backed mounts, longest mountPath first."""
    found = [(m["mountPath"], os.path.join(volumes[m["name"]].path, m.get("subPath", "")).rstrip("/"))
             for m in container.get("volumeMounts", []) if volumes[m["name"]].path]
    return sorted(found, key=lambda item: -len(item[0]))


def _local_path(value: str, mounts: list[tuple[str, str]]) -> str:
    for mount_path, local in mounts:
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return local + value[len(mount_path.rstrip("/")):]
    return value


def localize(rendered: RenderedDeployment, workdir: pathlib.Path, host_paths: dict[str, str]) -> list[LocalPod]:
    """Every rendered pod's containers as local commands (see the module docstring)."""
    pods = [copy.deepcopy(pod) for pod in rendered.pods()]
    network = LocalNetwork(rendered, pods)
    local_pods = []
    for pod in pods:
        for volume in pod["spec"].get("volumes", []):
            if "hostPath" in volume:
                volume["hostPath"]["path"] = host_paths[volume["hostPath"]["path"]]
        pod_dir = workdir / pod["metadata"]["name"]
        volumes = prepare_volumes(rendered, pod, pod_dir / "volumes", workdir / "claims")
        local = LocalPod(pod, network.ports_of(pod))
        for kind in ("initContainers", "containers"):
            for container in pod["spec"].get(kind) or []:
                mounts = _mount_paths(container, volumes)
                mounts.append((container.get("terminationMessagePath", "/dev/termination-log"),
                               str(pod_dir / f"{container['name']}.termination-log")))
                env = {k: _local_path(v, mounts) for k, v in container_env(rendered, pod, container, {}).items()}
                argv = [_local_path(a, mounts) for a in network.rewrite(rendered.argv(container, env), local.ports)]
                argv = [*_ENTRYPOINTS.get(argv[0], argv[:1]), *argv[1:]]
                argv = [_SHUTDOWN_GRACE if i and argv[i - 1] == "--shutdown-grace-period-secs" else arg
                        for i, arg in enumerate(argv)]
                command = Command(f"{local.name}/{container['name']}", argv, {**env, **_NODE_ENV}, pod_dir)
                (local.init if kind == "initContainers" else local.main).append(command)
        local_pods.append(local)
    return local_pods


def tiny_model_host_paths(spec: DeploymentSpec, root: pathlib.Path) -> dict[str, str]:
    """`host_paths` for a spec whose model is a hostPath: its node path -> a directory under `root`
    holding the tiny checkpoint where the pods look for it (model.path, under the model mount)."""
    from deepseek_pd.model.checkpoint.tiny import ensure_tiny_model

    models = root / "models"
    models.mkdir()
    (models / pathlib.Path(spec.model.path).relative_to(names.MODEL_MOUNT)).symlink_to(ensure_tiny_model())
    return {spec.model.volume["hostPath"]["path"]: str(models)}
