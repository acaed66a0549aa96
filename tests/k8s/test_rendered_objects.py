"""What the operator renders, created on a real kube-apiserver: the server validates every object
strictly (unknown fields are errors), its admission plugins judge the pods (PodSecurity
"restricted", ServiceAccount token injection), and the chart's namespaced Role is exactly enough
to create all of it, as the operator's own ServiceAccount.
"""
from __future__ import annotations

import base64
import pathlib
import random
import subprocess

import pytest
import yaml
from control_plane import ISSUER
from kube_rest import Credentials, Kube, KubeError

from deepseek_pd.operator import names
from deepseek_pd.operator.build_secret import build_internal_secret
from deepseek_pd.operator.build_workers import build_group_service, build_group_statefulset
from deepseek_pd.operator.reconcile import build_static_children
from deepseek_pd.operator.router_keys import build_control_plane_secret
from deepseek_pd.operator.spec import DeploymentSpec
from pdtest.waiting import wait_until as _wait

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]
# The test's own map of where each kind lives (not the operator's: the harness checks it).
PATHS = {
    "Secret": "/api/v1/namespaces/{ns}/secrets", "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Service": "/api/v1/namespaces/{ns}/services",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "StatefulSet": "/apis/apps/v1/namespaces/{ns}/statefulsets",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
}




def _namespace(kube: Kube, prefix: str, labels: dict[str, str] | None = None) -> str:
    name = f"{prefix}-{random.randrange(10**6)}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                       "metadata": {"name": name, "labels": labels or {}}})
    # Pods need the namespace's "default" ServiceAccount (the controller-manager makes it).
    _wait(lambda: kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 30, "default ServiceAccount")
    return name


def _create(kube: Kube, obj: dict) -> dict:
    """POST with strict field validation: a field the server does not know is an error."""
    path = PATHS[obj["kind"]].format(ns=obj["metadata"]["namespace"])
    return kube.request("POST", path, obj, params={"fieldValidation": "Strict"})


def _rendered(spec: DeploymentSpec) -> list[dict]:
    """Everything one reconcile pass creates, Secrets first (as reconcile does)."""
    objects = [build_internal_secret(spec.name, spec.namespace), build_control_plane_secret(spec),
               *build_static_children(spec)]
    for role in names.ROLES:
        for index in range(spec.role(role).replicas):
            objects += [build_group_service(spec, role, index), build_group_statefulset(spec, role, index)]
    return objects


def _spec(example: str, name: str, namespace: str, **overrides) -> DeploymentSpec:
    raw = yaml.safe_load((ROOT / "examples" / example).read_text())["spec"]
    raw.update(overrides)
    return DeploymentSpec.parse(name, namespace, raw)


def _pods(kube: Kube, namespace: str, deployment: str) -> list[dict]:
    return kube.list(PATHS["Pod"].format(ns=namespace),
                     labelSelector=f"{names.LABEL_DEPLOYMENT}={deployment}")


def _token(kube: Kube, namespace: str, service_account: str) -> str:
    review = kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": [ISSUER], "expirationSeconds": 3600}})
    return review["status"]["token"]


@pytest.fixture(scope="module")
def helm() -> pathlib.Path:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_k8s_tools.sh")], check=True,
                         capture_output=True, text=True, timeout=170)
    return pathlib.Path(out.stdout.strip().splitlines()[-1]) / "helm" / "helm"


def _chart_rbac(helm: pathlib.Path, namespace: str) -> list[dict]:
    """The chart's ServiceAccount, Role and RoleBinding installed into `namespace` (by default the
    operator watches its release namespace, with a Role there)."""
    out = subprocess.run([str(helm), "template", "deepseek", str(ROOT / "charts"), "--namespace", namespace],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    return [d for d in docs if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]


def test_rendered_objects_are_valid_and_pass_pod_security_restricted_as_the_operator(admin_kube, helm):
    """A tcp deployment with its checkpoint on a PVC: every object is created by the operator's
    ServiceAccount holding only the chart's namespaced Role, and every pod the StatefulSet and
    ReplicaSet controllers make is admitted under PodSecurity `restricted`."""
    ns = _namespace(admin_kube, "rendered", {"pod-security.kubernetes.io/enforce": "restricted",
                                             "pod-security.kubernetes.io/enforce-version": "latest"})
    rbac = _chart_rbac(helm, ns)
    assert sorted(d["kind"] for d in rbac) == ["Role", "RoleBinding", "ServiceAccount"]
    for obj in rbac:
        _create(admin_kube, obj)
    account = next(d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]["name"]
    operator = Kube(Credentials(admin_kube.creds.server, _token(admin_kube, ns, account), admin_kube.creds.ca_path))

    name = "tiny"
    spec = _spec("cpu-minimal.yaml", name, ns, model={"source": {"pvc": {"claimName": "weights"}},
                                                      "path": "tiny", "servedName": "tiny"})
    for obj in _rendered(spec):
        _create(operator, obj)
    # ...and the Selector router's Role, which the operator may grant only because it holds pods
    # get/list/watch itself (RBAC's escalation check).
    selector = _spec("cpu-minimal.yaml", "sel", ns, router={"workerDiscovery": "Selector"})
    for obj in build_static_children(selector):
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            _create(operator, obj)

    # What the Role does not give: listing Secrets, or anything in another namespace.
    with pytest.raises(KubeError) as info:
        operator.list(PATHS["Secret"].format(ns=ns))
    assert info.value.status == 403
    other = _namespace(admin_kube, "elsewhere")
    with pytest.raises(KubeError) as info:
        _create(operator, build_internal_secret(name, other))
    assert info.value.status == 403

    expected = spec.prefill.replicas * spec.prefill.size + spec.decode.replicas * spec.decode.size + \
        spec.router.replicas
    pods = _wait(lambda: (p := _pods(admin_kube, ns, name)) and len(p) == expected and p, 60,
                 f"{expected} pods admitted under PodSecurity restricted")
    for pod in pods:
        pod_spec = pod["spec"]
        volumes = [v["name"] for v in pod_spec["volumes"]]
        # automountServiceAccountToken: false is honoured: no projected API token in the pod.
        assert not [v for v in volumes if v.startswith("kube-api-access")], pod["metadata"]["name"]
        assert pod_spec["securityContext"]["runAsNonRoot"] is True
        assert pod_spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod_spec["containers"]:
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
        if names.LABEL_ROLE in pod["metadata"]["labels"]:
            secret = next(v for v in pod_spec["volumes"] if "secret" in v)["secret"]
            assert secret == {"secretName": f"{name}-internal", "defaultMode": 0o400}
    # The judges are awake: the same worker pod without its security context is refused by
    # PodSecurity, and a misspelt field by strict validation.
    worker = next(p for p in pods if names.LABEL_ROLE in p["metadata"]["labels"])
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare", "namespace": ns},
            "spec": {k: v for k, v in worker["spec"].items() if k not in ("securityContext", "nodeName")}}
    bare["spec"]["containers"] = [{k: v for k, v in c.items() if k != "securityContext"}
                                  for c in worker["spec"]["containers"]]
    with pytest.raises(KubeError) as info:
        _create(admin_kube, bare)
    assert info.value.status == 403 and "restricted" in str(info.value)
    typo = build_internal_secret("typo", ns)
    typo["metadata"]["lables"] = typo["metadata"].pop("labels")
    with pytest.raises(KubeError) as info:
        _create(admin_kube, typo)
    assert info.value.status in (400, 422) and "lables" in str(info.value)
    stored = admin_kube.get(f"{PATHS['Secret'].format(ns=ns)}/{name}-internal")
    assert len(base64.b64decode(stored["data"]["internal.secret"])) == 64
    admin_kube.delete(f"/api/v1/namespaces/{ns}")
    admin_kube.delete(f"/api/v1/namespaces/{other}")


def test_rdma_multinode_example_is_valid_and_its_network_policy_is_stored_as_rendered(admin_kube):
    """The H200 example (Mooncake over RDMA, IPC_LOCK, 4-pod decode groups) in a namespace without
    PodSecurity enforcement: strictly valid objects, and the NetworkPolicy's port ranges survive."""
    ns = _namespace(admin_kube, "rendered-rdma")
    spec = _spec("deepseek-v3-h200.yaml", "v3", ns)
    created = {}
    for obj in _rendered(spec):
        created[(obj["kind"], obj["metadata"]["name"])] = _create(admin_kube, obj)
    policy = admin_kube.get(f"{PATHS['NetworkPolicy'].format(ns=ns)}/{names.network_policy_name('v3')}")
    rendered = next(o for o in _rendered(spec) if o["kind"] == "NetworkPolicy")
    assert policy["spec"]["ingress"] == rendered["spec"]["ingress"]
    ranges = [p for rule in policy["spec"]["ingress"] for p in rule["ports"] if "endPort" in p]
    assert ranges and all(p["endPort"] > p["port"] for p in ranges)
    def decode_pods() -> list[dict]:
        return [p for p in _pods(admin_kube, ns, "v3") if p["metadata"]["labels"].get(names.LABEL_ROLE) == "decode"]

    worker = _wait(decode_pods, 60, "decode pods")[0]
    caps = worker["spec"]["containers"][0]["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": list(spec.rdma.capabilities)}
    args = worker["spec"]["containers"][0]["args"]
    assert args[args.index("--prefill-peers") + 1].startswith("v3-prefill-*-0.v3-prefill-*.")
    admin_kube.delete(f"/api/v1/namespaces/{ns}")


def _install_crd(kube: Kube) -> str:
    from deepseek_pd.operator.crd import crd_yaml

    crd = yaml.safe_load(crd_yaml())
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
    if kube.get(path) is None:
        kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

    def served() -> bool:
        try:
            kube.list(f"/apis/{names.API_VERSION}/namespaces/default/{names.PLURAL}")
            return True
        except KubeError:
            return False

    _wait(served, 30, "CRD served")
    return f"/apis/{names.API_VERSION}/namespaces/{{ns}}/{names.PLURAL}"


def test_reconcile_on_the_real_server_creates_secrets_once_and_reports_a_missing_api_key(admin_kube):
    """The operator's own Reconciler and KubeClient against the apiserver: the Secrets survive a
    second pass unchanged, and the SecretsReady condition is accepted by the CRD's status schema."""
    import asyncio
    import logging

    import kopf

    from deepseek_pd.operator.kube import KubeClient
    from deepseek_pd.operator.reconcile import Reconciler

    crs = _install_crd(admin_kube)
    ns = _namespace(admin_kube, "reconciled")
    body = yaml.safe_load((ROOT / "examples" / "cpu-minimal.yaml").read_text())
    body["metadata"] = {"name": "tiny", "namespace": ns}
    body["spec"]["router"] = {"apiKeySecret": {"name": "client-keys"}}
    cr = admin_kube.create(crs.format(ns=ns), body)
    creds = admin_kube.creds
    client = KubeClient(lambda: kopf.ConnectionInfo(server=creds.server, ca_path=str(creds.ca_path),
                                                    token=creds.token))
    log = logging.getLogger("test")

    async def secrets() -> dict[str, dict]:
        return {s: await client.get("Secret", ns, f"tiny-{s}") for s in ("internal", "router-control-plane")}

    async def two_passes() -> tuple[dict, dict, dict, dict]:
        try:
            reconciler = Reconciler(client)
            first = await reconciler.reconcile(cr, log)
            secrets_after_first = await secrets()
            second = await reconciler.reconcile({**cr, "status": first}, log)
            return first, second, secrets_after_first, await secrets()
        finally:
            await client.close()

    first, second, before, after = asyncio.run(two_passes())
    assert all(before.values()) and {k: v["data"] for k, v in before.items()} == \
        {k: v["data"] for k, v in after.items()}
    for secret in after.values():
        assert secret["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
    condition = next(c for c in second["conditions"] if c["type"] == "SecretsReady")
    assert condition["status"] == "False" and "client-keys" in condition["message"]
    # The status as the handlers write it: the server's schema accepts the condition type.
    stored = admin_kube.merge_patch(f"{crs.format(ns=ns)}/tiny/status", {"status": second})
    assert {c["type"] for c in stored["status"]["conditions"]} >= {"SecretsReady", "Available"}
    assert admin_kube.get(f"{PATHS['NetworkPolicy'].format(ns=ns)}/{names.network_policy_name('tiny')}")
    admin_kube.delete(f"{crs.format(ns=ns)}/tiny")
    admin_kube.delete(f"/api/v1/namespaces/{ns}")


def test_a_plan_that_does_not_fit_creates_nothing_on_the_real_server(admin_kube):
    """The V3 example on one node in bf16: the server takes `model.architecture` and the
    MemoryPlanFits condition (its schemas are the generated CRD's), and no child appears."""
    import asyncio
    import logging

    import kopf

    from deepseek_pd.operator.kube import KubeClient
    from deepseek_pd.operator.reconcile import Reconciler

    crs = _install_crd(admin_kube)
    ns = _namespace(admin_kube, "memplan")
    body = yaml.safe_load((ROOT / "examples" / "deepseek-v3-h200.yaml").read_text())
    body["metadata"] = {"name": "v3", "namespace": ns}
    body["spec"]["model"]["architecture"] = "DeepSeek-V3"
    body["spec"]["prefill"].update(size=1, parallelism={"tp": 1, "dp": 8, "ep": 8},
                                   engineArgs=["--engine-opt", "fp8_backend=dequant"])
    cr = admin_kube.request("POST", crs.format(ns=ns), body, params={"fieldValidation": "Strict"})
    creds = admin_kube.creds
    client = KubeClient(lambda: kopf.ConnectionInfo(server=creds.server, ca_path=str(creds.ca_path),
                                                    token=creds.token))

    async def one_pass() -> dict:
        try:
            return await Reconciler(client).reconcile(cr, logging.getLogger("test"))
        finally:
            await client.close()

    status = asyncio.run(one_pass())
    stored = admin_kube.merge_patch(f"{crs.format(ns=ns)}/v3/status", {"status": status})["status"]
    memory = next(c for c in stored["conditions"] if c["type"] == "MemoryPlanFits")
    assert (stored["phase"], memory["status"], memory["reason"]) == ("Failed", "False", "DoesNotFit")
    for kind in ("StatefulSet", "Deployment", "Service", "ConfigMap", "Secret"):
        assert not [o for o in admin_kube.list(PATHS[kind].format(ns=ns))
                    if o["metadata"]["name"].startswith("v3")], kind
    admin_kube.delete(f"{crs.format(ns=ns)}/v3")
    admin_kube.delete(f"/api/v1/namespaces/{ns}")
