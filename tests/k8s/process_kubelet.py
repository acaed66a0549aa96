"""The process kubelet: a Node whose pods run as local processes, for the end-to-end tests.

The control plane (control_plane.py) has no kubelet, and a scheduler only when a test starts the
real one. This is a kubelet and a scheduler, for one node:

    ProcessKubelet(kube, KubeletConfig(workdir=..., image_env=...)).start()
        registers Node `config.node_name` (Ready, capacity = config.capacity);
        every `poll_s`:
          schedules: binds each unscheduled pod of the default scheduler name (the real
            kube-scheduler binds those that name it: control_plane.REAL_SCHEDULER; then this
            only runs them) whose nodeSelector matches the node and whose resource requests fit the node's capacity (pods' requests are not summed: one
            node, test-sized); one that does not fit gets PodScheduled=False/Unschedulable with
            kube-scheduler's wording ("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.");
          runs: a PodWorker (pod_worker.py) per pod bound to the node, keyed by UID;
          deletes: a pod with a deletionTimestamp (or gone) is stopped, then its object removed;
          resolves: rewrites every pod's /etc/hosts from the EndpointSlices (cluster_hosts.py) and
            answers the same names over DNS on the node's address (cluster_dns.py).
    .stop() stops every pod and removes the node and the pod network.

Containers are not images: `command`/`args` run inside the pod's sandbox (pod_sandbox.py: own
network namespace and IP on a bridge, overlay root, volumes at their mountPaths) with the
environment an image would give (`image_env`: PATH to the checkout's venv, HOME) plus the pod's
env. The image name is reported and looked up in the node's registry (image_registry.py,
`config.images`; None: every name), never pulled: a name the registry lacks leaves the container
in ErrImagePull / ImagePullBackOff until it is pushed (`kubelet.registry.push`). Probes and
restart back-offs run faster than a kubelet's (caps in KubeletConfig); everything else follows
the pod's spec.
"""
from __future__ import annotations

import logging
import pathlib
import threading
from dataclasses import dataclass, field
from typing import Any

from cluster_dns import DnsServer
from cluster_hosts import cluster_entries
from image_registry import ImageRegistry
from kube_rest import Kube, KubeError
from pdtest.pod_inputs import quantity
from pod_sandbox import PodNetwork, sandbox_support
from pod_worker import PodWorker, now_rfc3339
from service_proxy import TcpForwarder

Obj = dict[str, Any]
log = logging.getLogger("process-kubelet")
__all__ = ["KubeletConfig", "ProcessKubelet", "sandbox_support"]


@dataclass(frozen=True)
class KubeletConfig:
    workdir: pathlib.Path
    image_env: dict[str, str]
    node_name: str = "process-node"
    labels: dict[str, str] = field(default_factory=dict)
    capacity: dict[str, str] = field(default_factory=lambda: {
        "cpu": "16", "memory": "64Gi", "ephemeral-storage": "100Gi", "pods": "110"})
    poll_s: float = 0.5
    tick_s: float = 0.2
    probe_period_cap_s: float = 1.0
    restart_backoff_s: float = 1.0
    restart_backoff_cap_s: float = 5.0
    termination_grace_cap_s: float = 10.0
    apiserver: tuple[str, int] | None = None  # served to pods as the `kubernetes` Service
    images: frozenset[str] | None = None  # what the node's registry holds; None: every name pulls


KUBERNETES_SERVICE = "kubernetes.default.svc"  # a name in the apiserver's certificate (pki.py)


class ProcessKubelet:
    def __init__(self, kube: Kube, config: KubeletConfig) -> None:
        self.kube = kube
        self.config = config
        self.name = config.node_name
        self.network = PodNetwork()
        self.registry = ImageRegistry(config.images)
        self.workers: dict[str, PodWorker] = {}
        self._entries: list[tuple[str, str]] = []
        self._unschedulable: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="process-kubelet", daemon=True)
        self._lock = threading.Lock()
        self._forwarder: TcpForwarder | None = None
        self._dns: DnsServer | None = None
        self._names: dict[str, list[str]] = {}

    # ---------------------------------------------------------------- node
    def _node(self) -> Obj:
        labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", **self.config.labels}
        now = now_rfc3339()
        return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": labels},
                "status": {"capacity": self.config.capacity, "allocatable": self.config.capacity,
                           "addresses": [{"type": "InternalIP", "address": self.network.gateway},
                                         {"type": "Hostname", "address": self.name}],
                           "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                           "message": "process kubelet is posting ready status",
                                           "lastHeartbeatTime": now, "lastTransitionTime": now}],
                           "nodeInfo": {"kubeletVersion": "process-kubelet", "operatingSystem": "linux",
                                        "architecture": "amd64", "containerRuntimeVersion": "process://",
                                        "kernelVersion": "", "osImage": "", "kubeProxyVersion": "",
                                        "machineID": "", "systemUUID": "", "bootID": ""}}}

    def start(self) -> "ProcessKubelet":
        reason = sandbox_support()
        if reason:
            raise RuntimeError(reason)
        (self.config.workdir / "pods").mkdir(parents=True, exist_ok=True)
        self.network.create()
        self._dns = DnsServer(self.network.gateway, lambda name: self._names.get(name, [])).start()
        if self.config.apiserver:
            self._forwarder = TcpForwarder((self.network.gateway, 443), self.config.apiserver).start()
        node = self._node()
        try:
            self.kube.create("/api/v1/nodes", {k: v for k, v in node.items() if k != "status"})
        except KubeError as exc:
            if exc.status != 409:
                raise
        self.kube.request("PATCH", f"/api/v1/nodes/{self.name}/status", {"status": node["status"]},
                          content_type="application/merge-patch+json")
        # The API server taints a new Node not-ready (TaintNodesByCondition); the node lifecycle
        # controller, off here, would lift it once Ready. kube-scheduler honours the taint.
        self.kube.request("PATCH", f"/api/v1/nodes/{self.name}", {"spec": {"taints": None}},
                          content_type="application/merge-patch+json")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.terminate(0)
        for worker in workers:
            worker.join(30)
        if self._forwarder is not None:
            self._forwarder.stop()
        if self._dns is not None:
            self._dns.stop()
        self.network.delete()
        try:
            self.kube.delete(f"/api/v1/nodes/{self.name}")
        except KubeError:
            pass

    def hosts_entries(self) -> list[tuple[str, str]]:
        return self._entries

    # ---------------------------------------------------------------- loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception:  # noqa: BLE001 (an apiserver hiccup: try again next poll)
                log.exception("process kubelet: sync failed")
            self._stop.wait(self.config.poll_s)

    def _sync(self) -> None:
        pods = self.kube.list("/api/v1/pods")
        for pod in pods:
            if not pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                self._schedule(pod)
        entries = cluster_entries(self.kube)
        if self.config.apiserver:
            entries.insert(0, (self.network.gateway, KUBERNETES_SERVICE))
        names: dict[str, list[str]] = {}
        for ip, name in entries:
            names.setdefault(name, []).append(ip)
        self._entries, self._names = entries, names
        mine = {p["metadata"]["uid"]: p for p in pods if p["spec"].get("nodeName") == self.name}
        with self._lock:
            for uid, pod in mine.items():
                worker = self.workers.get(uid)
                deleting = pod["metadata"].get("deletionTimestamp")
                if worker is None and not deleting and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                    worker = self.workers[uid] = PodWorker(self.kube, pod, self)
                    worker.start()
                elif worker is not None and deleting:
                    worker.terminate(float(pod["metadata"].get("deletionGracePeriodSeconds") or 0))
                elif worker is None and deleting:  # never ran here: nothing to stop
                    self._finish_delete(pod)
            for uid, worker in list(self.workers.items()):
                if uid not in mine:
                    worker.terminate(0)
                if worker.done:
                    del self.workers[uid]
                else:
                    worker.refresh_hosts(self._entries)

    def _finish_delete(self, pod: Obj) -> None:
        meta = pod["metadata"]
        try:
            self.kube.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                             gracePeriodSeconds=0, preconditions={"uid": meta["uid"]})
        except KubeError:
            pass

    # ---------------------------------------------------------------- scheduler
    def _misfit(self, pod: Obj) -> str:
        """Why the pod cannot run on this node, in kube-scheduler's words; "" when it can."""
        spec = pod["spec"]
        if spec.get("schedulerName", "default-scheduler") != "default-scheduler":
            return "not ours"
        labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", **self.config.labels}
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
        short = set()
        for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
            requests = (container.get("resources") or {}).get("requests") or {}
            limits = (container.get("resources") or {}).get("limits") or {}
            for resource, value in {**limits, **requests}.items():
                have = self.config.capacity.get(resource)
                if have is None or quantity(value) > quantity(have):
                    short.add(resource)
        if short:
            reasons = ", ".join(f"1 Insufficient {r}" for r in sorted(short))
            return f"0/1 nodes are available: {reasons}."
        return ""

    def _schedule(self, pod: Obj) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        misfit = self._misfit(pod)
        if misfit == "not ours":
            return
        if misfit:
            if self._unschedulable.get(meta["uid"]) != misfit:
                condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                             "message": misfit, "lastTransitionTime": now_rfc3339()}
                try:
                    self.kube.request("PATCH", f"{path}/status", {"status": {"conditions": [condition]}},
                                      content_type="application/strategic-merge-patch+json")
                    self._unschedulable[meta["uid"]] = misfit
                except KubeError:
                    pass
            return
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": self.name}}
        try:
            self.kube.create(f"{path}/binding", binding)
        except KubeError as exc:
            if exc.status not in (404, 409):
                log.warning("cannot bind %s: %s", path, exc)
