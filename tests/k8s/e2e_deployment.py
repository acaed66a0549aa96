"""The deployment the operator end-to-end test (test_operator_e2e.py) drives: the cluster's tools,
the admin kubeconfig and the applied DeepSeekDeployment, plus `run_tool` for the CLIs.

    Deployment(kube, kubelet, tools, kubeconfig, workdir)
        .cr() / .pods(selector)     the resource and its pods
        .wait_phase(phase, where)   status.phase reached for the current generation
        .router_url()               the router Service's ready endpoint
        .diagnose()                 CR status, every pod, the tail of every container log
    installed_release(...)          `helm install` of charts/ as a context manager: the Deployment,
                                    with its namespace created; uninstalled on exit
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
from collections.abc import Iterator

import pytest

from pdtest.waiting import wait_until

NS, OPS = "llm", "ops"
CR_API = "/apis/deepseek-pd.io/v1alpha1"


def run_tool(*argv, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
    """Runs a CLI (helm, kubectl, deepseek-pd); a non-zero exit fails the test with its output."""
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        pytest.fail(f"{' '.join(map(str, argv))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


class Deployment:
    """The session's cluster as the tests see it: tools, kubeconfig, the applied CR."""

    def __init__(self, kube, kubelet, tools: pathlib.Path, kubeconfig: pathlib.Path, workdir: pathlib.Path,
                 namespace: str = NS):
        self.kube, self.kubelet, self.workdir = kube, kubelet, workdir
        self.helm, self.kubectl = tools / "helm" / "helm", tools / "kubectl" / "kubectl"
        self.kubeconfig = kubeconfig
        self.namespace = namespace  # where the DeepSeekDeployments go
        self.name = "tiny"

    def kubectl_run(self, *args, check: bool = True) -> subprocess.CompletedProcess:
        return run_tool(self.kubectl, f"--kubeconfig={self.kubeconfig}", *args, check=check)

    def cr(self) -> dict | None:
        return self.kube.get(f"{CR_API}/namespaces/{self.namespace}/deepseekdeployments/{self.name}")

    def pods(self, selector: str = "") -> list[dict]:
        selector = selector or f"deepseek-pd.io/deployment={self.name}"
        return self.kube.list(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=selector)

    def diagnose(self) -> str:
        """Everything a failed wait needs: CR status, pods, the tail of every container log."""
        lines = [f"CR status: {json.dumps((self.cr() or {}).get('status'), indent=1)[:3000]}"]
        for pod in self.kube.list("/api/v1/pods"):
            status = pod.get("status", {})
            lines.append(f"pod {pod['metadata']['namespace']}/{pod['metadata']['name']} "
                         f"{status.get('phase')} {[(c['type'], c['status']) for c in status.get('conditions', [])]} "
                         f"{[(c['name'], c['restartCount'], list(c['state'])) for c in status.get('containerStatuses', [])]}")
        for log in sorted((self.kubelet.config.workdir / "pods").glob("*/logs/*.log")):
            lines.append(f"--- {log}\n{log.read_text(errors='replace')[-2500:]}")
        return "\n".join(lines)

    def wait_phase(self, phase: str, timeout_s: float = 300, where=None) -> dict:
        def reached():
            cr = self.cr() or {}
            status = cr.get("status") or {}
            ok = status.get("phase") == phase and status.get("observedGeneration") == cr["metadata"]["generation"]
            return cr if ok and (where is None or where(cr)) else None
        return wait_until(reached, timeout_s, f"{self.name} not {phase}", self.diagnose)

    def router_url(self) -> str:
        """The router Service's ready endpoint (what kube-proxy would send to)."""
        def endpoint():
            slices = self.kube.list(f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices",
                                    labelSelector=f"kubernetes.io/service-name={self.name}-router")
            for slice_ in slices:
                # By name: the Service also has the gateway's metrics port, in no promised order.
                port = next(p["port"] for p in slice_["ports"] if p.get("name") == "http")
                for ep in slice_.get("endpoints") or []:
                    if ep.get("conditions", {}).get("ready"):
                        return f"http://{ep['addresses'][0]}:{port}"
            return None
        return wait_until(endpoint, 60, "router Service has no ready endpoint", self.diagnose)


@contextlib.contextmanager
def installed_release(control_plane, kube, kubelet, workdir: pathlib.Path, release: str, operator_ns: str,
                      namespace: str, *helm_args: str) -> Iterator[Deployment]:
    """`helm install <release> charts/` into `operator_ns` (waiting for the operator), and
    `namespace` created for the resources; on exit its resources deleted, the namespace too, and
    the release uninstalled."""
    root = pathlib.Path(__file__).resolve().parents[2]
    out = run_tool("bash", root / "scripts" / "fetch_k8s_tools.sh", timeout=170)
    tools = pathlib.Path(out.stdout.strip().splitlines()[-1])
    kubeconfig = control_plane.admin.kubeconfig(workdir / "admin.kubeconfig", "admin")
    dep = Deployment(kube, kubelet, tools, kubeconfig, workdir, namespace)
    helm = (f"--kubeconfig={kubeconfig}", "--namespace", operator_ns)
    # The operator watches `namespace` only (the chart's default RBAC is a Role there), so it exists first.
    dep.kubectl_run("create", "namespace", namespace)
    run_tool(dep.helm, "install", release, root / "charts", *helm, "--create-namespace",
             "--set", f"operator.watchNamespaces={{{namespace}}}", *helm_args, "--wait", "--timeout", "180s")
    wait_until(lambda: kube.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default"), 30, "no default SA")
    try:
        yield dep
    finally:
        # The resources go while their operator runs: its finalizer would keep them otherwise.
        dep.kubectl_run("delete", "deepseekdeployments", "--all", "-n", namespace, "--wait=true",
                        "--timeout=120s", check=False)
        dep.kubectl_run("delete", "namespace", namespace, "--wait=false", check=False)
        run_tool(dep.helm, "uninstall", release, *helm, check=False)
