"""The model download's objects on a REAL kube-apiserver: the operator's own Reconciler and
KubeClient create every child (StatefulSets with the `model` init container, the cache claim, the
router) for each cache kind, so the server validates them; the StatefulSet controller makes pods
from them; the test writes the init container's states as the kubelet would, and the ModelReady
status the operator computes from the listed pods is accepted by the CRD's status subresource."""
from __future__ import annotations

import asyncio
import logging
import random

import kopf
import pytest
import yaml
from kube_rest import KubeError
from pdtest.hub_specs import CACHE_KINDS, hub_spec

from deepseek_pd.operator import names
from deepseek_pd.operator.build_model import INIT_CONTAINER
from deepseek_pd.operator.crd import crd_yaml
from deepseek_pd.operator.kube import KubeClient
from deepseek_pd.operator.reconcile import Reconciler
from deepseek_pd.weights.failures import EXIT_CODES, DownloadError
from deepseek_pd.weights.layout import snapshot_dir
from pdtest.waiting import wait_until as _wait

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
LOG = logging.getLogger("test")
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"




def _events(admin_kube, namespace: str) -> str:
    return "; ".join(f"{e['involvedObject']['name']}: {e.get('reason')}: {e.get('message')}"
                     for e in admin_kube.list(f"/api/v1/namespaces/{namespace}/events"))


def apply_crd(admin_kube, crd: dict) -> None:
    """Installs the CRD, or updates the session's copy to it (an earlier module installed it)."""
    name = crd["metadata"]["name"]
    current = admin_kube.get(f"{CRDS}/{name}")
    if current is None:
        admin_kube.create(CRDS, crd)
    else:
        crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        admin_kube.request("PUT", f"{CRDS}/{name}", crd)


@pytest.fixture(scope="module")
def dsd_path(admin_kube):
    """The CRD as `deepseek-pd operator crd` renders it, installed (or updated to it)."""
    apply_crd(admin_kube, yaml.safe_load(crd_yaml()))
    namespace = f"weights-{random.randrange(10**6)}"
    admin_kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                             "metadata": {"name": namespace}})
    path = f"/apis/{names.API_VERSION}/namespaces/{namespace}/{names.PLURAL}"

    def served():
        try:
            return admin_kube.list(path) is not None
        except KubeError:
            return False
    _wait(served, 30, "CRD not served")
    return path


def _reconciler(admin_kube) -> Reconciler:
    creds = admin_kube.creds
    info = kopf.ConnectionInfo(server=creds.server, token=creds.token, ca_path=str(creds.ca_path))
    return Reconciler(KubeClient(lambda: info))


def _pass(admin_kube, dsd_path: str, name: str) -> dict:
    """One operator pass against the real server, its status written through /status."""
    body = admin_kube.get(f"{dsd_path}/{name}")

    async def run() -> dict:
        reconciler = _reconciler(admin_kube)
        try:
            return await reconciler.reconcile(body, LOG)
        finally:
            await reconciler._client.close()
    status = asyncio.run(run())
    admin_kube.merge_patch(f"{dsd_path}/{name}/status", {"status": status})
    return admin_kube.get(f"{dsd_path}/{name}")["status"]


def _model_ready(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "ModelReady")


def _kubelet_writes(admin_kube, pod: dict, state: dict) -> None:
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    init = pod["spec"]["initContainers"][0]
    statuses = [{"name": init["name"], "image": init["image"], "imageID": "", "ready": False,
                 "restartCount": 0, "state": state}]
    admin_kube.merge_patch(f"/api/v1/namespaces/{ns}/pods/{name}/status",
                           {"status": {"phase": "Pending", "initContainerStatuses": statuses}})


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_rendered_children_are_accepted_and_model_ready_round_trips(admin_kube, dsd_path, cache_kind):
    rng = random.Random()
    name = f"w{rng.randrange(10**6)}"
    raw = hub_spec(rng, cache_kind, endpoint=f"https://mirror-{rng.randrange(99)}.example.com")
    # This test plays the kubelet. The session's process kubelet (started by the e2e modules) binds
    # and runs every pod it can, and overwrote the statuses written here; no node has this label.
    raw["scheduling"] = {"nodeSelector": {"deepseek-pd.io/test-node": f"none-{rng.randrange(10**6)}"}}
    namespace = dsd_path.split("/")[5]
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": raw})
    status = _pass(admin_kube, dsd_path, name)
    assert _model_ready(status)["reason"] == "Pending"

    if cache_kind == "size":
        claim = admin_kube.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/"
                               f"{names.model_cache_claim_name(name)}")
        assert claim["spec"]["resources"]["requests"]["storage"] == raw["model"]["cache"]["size"]
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    selector = f"{names.LABEL_DEPLOYMENT}={name},{names.LABEL_ROLE}"  # workers, not the router
    pods = _wait(lambda: (lambda p: p if len(p) == 2 else None)(admin_kube.list(pods_path, labelSelector=selector)),
                 60, "the StatefulSet controller made no pod per role", lambda: _events(admin_kube, namespace))
    hf = raw["model"]["source"]["huggingFace"]
    for pod in pods:  # as stored by the server, after its defaulting
        [init] = pod["spec"]["initContainers"]
        assert init["name"] == INIT_CONTAINER and init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        worker = pod["spec"]["containers"][0]
        model = worker["args"][worker["args"].index("--model") + 1]
        assert model == str(snapshot_dir(names.MODEL_CACHE_MOUNT, hf["id"], hf["revision"]))

    reason = rng.choice(sorted(EXIT_CODES))
    text = f"random detail {rng.randrange(10**9)}"
    failing = rng.choice(pods)
    _kubelet_writes(admin_kube, failing, {"terminated": {
        "exitCode": EXIT_CODES[reason], "reason": "Error", "message": DownloadError(reason, text).termination_message()}})
    condition = _model_ready(_pass(admin_kube, dsd_path, name))
    assert (condition["status"], condition["reason"]) == ("False", reason)
    assert condition["message"] == f"{failing['metadata']['name']}: {text}"

    for pod in pods:
        _kubelet_writes(admin_kube, pod, {"terminated": {"exitCode": 0, "reason": "Completed"}})
    condition = _model_ready(_pass(admin_kube, dsd_path, name))
    assert (condition["status"], condition["reason"]) == ("True", "Ready")
    bound = [p["metadata"]["name"] for p in admin_kube.list(pods_path, labelSelector=selector) if p["spec"].get("nodeName")]
    assert not bound, f"a kubelet other than this test's writes took {bound}"


def test_the_server_refuses_bad_cache_settings(admin_kube, dsd_path):
    rng = random.Random()
    for bad in ({"claimName": "a", "hostPath": "/x"}, {"storageClassName": "fast"}):
        raw = hub_spec(rng, "emptyDir")
        raw["model"]["cache"] = bad
        with pytest.raises(KubeError) as info:
            admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                         "metadata": {"name": f"bad{rng.randrange(10**6)}"}, "spec": raw})
        assert info.value.status == 422, info.value
