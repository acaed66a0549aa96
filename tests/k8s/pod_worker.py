"""One pod's life under the process kubelet, on its own thread: sandbox, init containers, containers,
probes, restarts, status, and teardown when the pod is deleted.

    PodWorker(kube, pod, node)  .start()   sandbox + volumes, then init containers in order, then
                                           every container as a process inside the sandbox
                                .terminate()  SIGTERM, the pod's grace period (capped), SIGKILL,
                                           sandbox gone, then the pod object is deleted (grace 0),
                                           as a kubelet finishes a graceful delete

Status goes to the pod's status subresource (strategic merge patch, so PodScheduled stays):
phase, podIP/hostIP, startTime, conditions (PodReadyToStartContainers, Initialized,
ContainersReady, Ready), containerStatuses/initContainerStatuses (state, lastState, ready,
started, restartCount). Restarts follow spec.restartPolicy with an exponential back-off capped at
`restart_backoff_cap_s`. Before its first start a container's image is looked up in the node's
registry (image_registry.py): one it lacks leaves the container waiting in ErrImagePull, then
ImagePullBackOff, retried with the same back-off. Every container of a pod shares one mount
namespace, so the union of the containers' volumeMounts is mounted (two containers mounting
different volumes at the same path are refused).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster_dns import resolv_conf
from cluster_hosts import hosts_file
from image_registry import ImageRegistry
from kube_rest import Kube, KubeError
from pdtest.pod_inputs import InputError, container_env, expand, prepare_volumes
from pod_mounts import container_mounts
from pod_sandbox import Mount, PodNetwork, Sandbox
from probes import ProbeState, attempt

Obj = dict[str, Any]
log = logging.getLogger("process-kubelet")


class Node(Protocol):
    """What a pod worker needs from its kubelet (process_kubelet.ProcessKubelet)."""

    name: str
    network: PodNetwork
    config: Any  # KubeletConfig
    registry: ImageRegistry

    def hosts_entries(self) -> list[tuple[str, str]]: ...


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerRun:
    """One container: its current process (if any) and what a containerStatus reports."""

    spec: Obj
    init: bool = False
    popen: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    started_at: str = ""
    restart_count: int = 0
    next_start: float = 0.0
    state: Obj = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Obj = field(default_factory=dict)
    probes: dict[str, ProbeState] = field(default_factory=dict)
    succeeded: bool = False  # an init container that exited 0
    pulled: bool = False  # its image was found; restarts do not look it up again
    pull_failures: int = 0

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def started(self) -> bool:
        startup = self.probes.get("startupProbe")
        return self.running and (startup is None or startup.ok is True)

    @property
    def ready(self) -> bool:
        readiness = self.probes.get("readinessProbe")
        return self.started and (readiness is None or readiness.ok is True)

    def status(self) -> Obj:
        return {"name": self.spec["name"], "image": self.spec.get("image", ""), "imageID": "",
                "containerID": f"process://{self.popen.pid}" if self.popen else "",
                "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
                "state": self.state, "lastState": self.last_state}


class PodWorker:
    def __init__(self, kube: Kube, pod: Obj, node: Node) -> None:
        self.kube = kube
        self.pod = pod
        self.node = node
        self.uid = pod["metadata"]["uid"]
        self.key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        self.dir = node.config.workdir / "pods" / self.uid
        hostname = pod["spec"].get("hostname") or pod["metadata"]["name"]
        self.sandbox = Sandbox(self.dir, node.network, hostname)
        self.inits = [ContainerRun(c, init=True) for c in pod["spec"].get("initContainers") or []]
        self.containers = [ContainerRun(c) for c in pod["spec"].get("containers") or []]
        self.start_time = now_rfc3339()
        self.config_error = ""
        self._stop = threading.Event()
        self._grace_s = 0.0
        self._thread = threading.Thread(target=self._main, name=f"pod-{self.key}", daemon=True)
        self._last_status: Obj = {}

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def terminate(self, grace_s: float) -> None:
        """Asks the worker to stop the pod and delete its object; returns at once."""
        self._grace_s = min(grace_s, self.node.config.termination_grace_cap_s)
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def _main(self) -> None:
        try:
            if self._setup():
                while not self._stop.is_set():
                    self._tick()
                    self._report()
                    self._stop.wait(self.node.config.tick_s)
        except Exception:  # noqa: BLE001 (a bug here must not take the kubelet down; it is logged)
            log.exception("pod %s: worker failed", self.key)
        finally:
            self._teardown()

    def _setup(self) -> bool:
        """Sandbox and volumes; on a missing input, reports it and retries until deleted."""
        while not self._stop.is_set():
            try:
                volumes = prepare_volumes(self.kube, self.pod, self.dir / "volumes",
                                          self.node.config.workdir / "claims")
                mounts = self._mounts(volumes)
                namespace = self.pod["metadata"]["namespace"]
                self.sandbox.start(mounts, hosts_file(self.node.hosts_entries()),
                                   resolv_conf(self.node.network.gateway, namespace))
                self.pod.setdefault("status", {})["podIP"] = self.sandbox.ip
                self.pod["status"]["hostIP"] = self.node.network.gateway
                self.config_error = ""
                self.refresh_hosts(self.node.hosts_entries())
                return True
            except (InputError, KubeError) as exc:
                self.config_error = str(exc)
                for run in self.inits + self.containers:
                    run.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                self._report()
                self._stop.wait(1.0)
        return False

    def _mounts(self, volumes) -> list[Mount]:
        by_target: dict[str, Mount] = {}
        for run in self.inits + self.containers:
            for mount in container_mounts(run.spec, volumes):
                if by_target.setdefault(mount.target, mount) != mount:
                    raise InputError(f"two containers mount different volumes at {mount.target}")
        return sorted(by_target.values(), key=lambda m: m.target.count("/"))

    def refresh_hosts(self, entries: list[tuple[str, str]]) -> None:
        if self.sandbox.ip:
            hostname = self.pod["spec"].get("hostname") or self.pod["metadata"]["name"]
            self.sandbox.write_hosts(hosts_file(entries, self.sandbox.ip, hostname))

    # ---------------------------------------------------------------- containers
    def _image_env(self) -> dict[str, str]:
        hostname = self.pod["spec"].get("hostname") or self.pod["metadata"]["name"]
        env = {**self.node.config.image_env, "HOSTNAME": hostname}
        if self.node.config.apiserver:  # what a kubelet injects for the `kubernetes` Service
            env.update(KUBERNETES_SERVICE_HOST="kubernetes.default.svc", KUBERNETES_SERVICE_PORT="443")
        return env

    def _pull(self, run: ContainerRun) -> bool:
        """Looks the container's image up once; a miss waits as a kubelet's failed pull does."""
        if run.pulled:
            return True
        image = run.spec.get("image", "")
        error = self.node.registry.pull_error(image)
        if not error:
            run.pulled = True
            return True
        config = self.node.config
        delay = min(config.restart_backoff_s * 2 ** run.pull_failures, config.restart_backoff_cap_s)
        if run.pull_failures == 0:
            run.state = {"waiting": {"reason": "ErrImagePull", "message": error}}
        else:
            run.state = {"waiting": {"reason": "ImagePullBackOff",
                                     "message": f'Back-off pulling image "{image}": {error}'}}
        run.pull_failures += 1
        run.next_start = time.monotonic() + delay
        return False

    def _launch(self, run: ContainerRun) -> None:
        spec = run.spec
        if not self._pull(run):
            return
        try:
            declared = container_env(self.kube, self.pod, spec, {})
            run.env = {**self._image_env(), **declared}
        except (InputError, KubeError) as exc:
            run.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
            run.next_start = time.monotonic() + 1.0
            return
        # $(VAR) sees the variables the pod spec declares, not the image's (as on a kubelet).
        argv = [expand(a, declared) for a in (spec.get("command") or []) + (spec.get("args") or [])]
        if not spec.get("command"):
            run.state = {"waiting": {"reason": "CreateContainerError",
                                     "message": "no command: the process kubelet has no image entrypoint"}}
            run.next_start = float("inf")
            return
        logs = self.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{spec['name']}.log", "ab") as out:
            out.write(f"--- start {run.restart_count}: {argv}\n".encode())
            out.flush()
            run.popen = subprocess.Popen(self.sandbox.exec_argv(argv, spec.get("workingDir", "/")),
                                         env=run.env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        run.started_at = now_rfc3339()
        run.state = {"running": {"startedAt": run.started_at}}
        cap = self.node.config.probe_period_cap_s
        run.probes = {kind: ProbeState(spec[kind], cap) for kind in
                      ("startupProbe", "readinessProbe", "livenessProbe") if spec.get(kind) and not run.init}

    def _should_restart(self, run: ContainerRun, code: int) -> bool:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if run.init:
            return code != 0 and policy != "Never"
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def _reap(self, run: ContainerRun, reason: str | None = None) -> None:
        """Records the exit of `run`'s process and schedules a restart if the policy says so."""
        assert run.popen is not None
        code = run.popen.returncode
        terminated = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                      "startedAt": run.started_at, "finishedAt": now_rfc3339(),
                      "containerID": f"process://{run.popen.pid}"}
        run.popen = None
        run.probes = {}
        if run.init and code == 0:
            run.succeeded = True
            run.state = {"terminated": terminated}
            return
        if self._should_restart(run, code):
            config = self.node.config
            delay = min(config.restart_backoff_s * 2 ** run.restart_count, config.restart_backoff_cap_s)
            run.restart_count += 1
            run.last_state = {"terminated": terminated}
            run.state = {"waiting": {"reason": "CrashLoopBackOff",
                                     "message": f"back-off {delay:.0f}s restarting failed container"}}
            run.next_start = time.monotonic() + delay
        else:
            run.state = {"terminated": terminated}
            run.next_start = float("inf")

    def _kill(self, run: ContainerRun, sig: int) -> None:
        if run.popen is not None and run.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.popen.pid, sig)

    def _tick(self) -> None:
        now = time.monotonic()
        pending_init = next((r for r in self.inits if not r.succeeded), None)
        if pending_init is not None:
            if pending_init.popen is not None and pending_init.popen.poll() is not None:
                self._reap(pending_init)
            elif pending_init.popen is None and now >= pending_init.next_start:
                self._launch(pending_init)
            return
        for run in self.containers:
            if run.popen is not None and run.popen.poll() is not None:
                self._reap(run)
            if run.popen is None and now >= run.next_start:
                self._launch(run)
            if run.running:
                self._probe(run, now)

    def _probe(self, run: ContainerRun, now: float) -> None:
        exec_argv = self.sandbox.exec_argv
        for kind, state in run.probes.items():
            if kind != "startupProbe" and not run.started:
                continue  # readiness and liveness wait for the startup probe
            if kind == "startupProbe" and state.ok:
                continue
            if not state.due(now):
                continue
            state.run(attempt(state.probe, run.spec, self.sandbox.ip, exec_argv, run.env), time.monotonic())
            if kind in ("startupProbe", "livenessProbe") and state.ok is False:
                log.info("pod %s: %s of %s failed, restarting it", self.key, kind, run.spec["name"])
                self._kill(run, signal.SIGKILL)
                run.popen.wait(timeout=10)
                self._reap(run, reason="Error")
                return

    # ---------------------------------------------------------------- status
    def _phase(self) -> str:
        if any(not r.succeeded for r in self.inits) or self.config_error:
            failed = any("terminated" in r.state and r.next_start == float("inf") for r in self.inits)
            return "Failed" if failed else "Pending"
        states = [r.state for r in self.containers]
        if all("terminated" in s and r.next_start == float("inf") for s, r in zip(states, self.containers)):
            return "Succeeded" if all(s["terminated"]["exitCode"] == 0 for s in states) else "Failed"
        if any(r.started_at for r in self.containers):
            return "Running"
        return "Pending"

    def _report(self) -> None:
        def condition(type_: str, ok: bool) -> Obj:
            return {"type": type_, "status": "True" if ok else "False"}

        initialized = all(r.succeeded for r in self.inits)
        ready = initialized and all(r.ready for r in self.containers)
        status = {
            "phase": self._phase(), "startTime": self.start_time,
            "hostIP": self.node.network.gateway, "hostIPs": [{"ip": self.node.network.gateway}],
            "conditions": [condition("PodReadyToStartContainers", bool(self.sandbox.ip)),
                           condition("Initialized", initialized),
                           condition("ContainersReady", ready), condition("Ready", ready)],
            "containerStatuses": [r.status() for r in self.containers],
        }
        if self.sandbox.ip:
            # A strategic merge would append to podIPs (merge key `ip`) when a new sandbox got a
            # new address; the apiserver then refuses two IPv4 entries. Replace the list.
            status.update(podIP=self.sandbox.ip, podIPs=[{"ip": self.sandbox.ip}, {"$patch": "replace"}])
        if self.inits:
            status["initContainerStatuses"] = [r.status() for r in self.inits]
        if status == self._last_status:
            return
        for cond in status["conditions"]:  # the transition time changes only with the status
            before = next((c for c in self._last_status.get("conditions", []) if c["type"] == cond["type"]), None)
            cond["lastTransitionTime"] = before["lastTransitionTime"] if before and \
                before["status"] == cond["status"] else now_rfc3339()
        meta = self.pod["metadata"]
        try:
            self.kube.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                              {"metadata": {"uid": self.uid}, "status": status},
                              content_type="application/strategic-merge-patch+json")
            self._last_status = status
        except KubeError as exc:
            if exc.status not in (404, 409):
                log.warning("pod %s: status update failed: %s", self.key, exc)

    # ---------------------------------------------------------------- teardown
    def _teardown(self) -> None:
        runs = self.inits + self.containers
        for run in runs:
            self._kill(run, signal.SIGTERM)
        deadline = time.monotonic() + self._grace_s
        while any(r.running for r in runs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for run in runs:
            self._kill(run, signal.SIGKILL)
            if run.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.popen.wait(timeout=10)
        self.sandbox.stop()
        meta = self.pod["metadata"]
        with contextlib.suppress(KubeError):
            self.kube.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                             gracePeriodSeconds=0, preconditions={"uid": self.uid})
