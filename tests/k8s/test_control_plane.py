"""The test control plane is a current Kubernetes: it reports the pinned release, enforces the
CRD's CEL rules (x-kubernetes-validations, which 1.20 silently dropped) and its controllers run
(StatefulSet -> Pod, garbage collection by owner references)."""
from __future__ import annotations

import copy
import pathlib
import random
import re

import pytest
import yaml

from kube_rest import KubeError
from pdtest.waiting import wait_until as _wait

pytestmark = [pytest.mark.timeout(2400), pytest.mark.slow]  # the first run builds the binaries
ROOT = pathlib.Path(__file__).resolve().parents[2]
GO_MOD = ROOT / "tests" / "k8s" / "controlplane" / "go.mod"




def test_reports_the_pinned_release(admin_kube):
    pinned = re.search(r"k8s\.io/kubernetes (v\S+)", GO_MOD.read_text()).group(1)
    assert admin_kube.request("GET", "/version")["gitVersion"] == pinned


# Found by this test, first run against a real 1.37 apiserver (kmock never validated the CRD): the
# apiserver checks each `default` as written against its object's CEL rules, and a rule's fieldPath
# against the declared schema; both were wrong (operator/schema_types.obj, crd.root_schema).
def test_crd_cel_rules_are_enforced(admin_kube):
    from deepseek_pd.operator.crd import crd_yaml

    crd = yaml.safe_load(crd_yaml())
    assert "x-kubernetes-validations" in crd_yaml()
    if admin_kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}") is None:
        admin_kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    group, version, plural = crd["spec"]["group"], crd["spec"]["versions"][0]["name"], crd["spec"]["names"]["plural"]
    path = f"/apis/{group}/{version}/namespaces/default/{plural}"
    _wait(lambda: _served(admin_kube, path), 30, "CRD not served")
    good = yaml.safe_load((ROOT / "examples" / "cpu-minimal.yaml").read_text())
    good["metadata"]["name"] = f"cel-{random.randrange(10**6)}"
    bad = copy.deepcopy(good)
    bad["metadata"]["name"] += "-bad"
    # The CRD's CEL rule: ep must divide the routed-expert count when it is given.
    bad["spec"]["model"]["numRoutedExperts"] = 7
    bad["spec"]["decode"]["parallelism"] = {"tp": 1, "dp": 2, "ep": 2}
    with pytest.raises(KubeError) as info:
        admin_kube.create(path, bad)
    assert info.value.status == 422, info.value
    assert admin_kube.create(path, good)["metadata"]["name"] == good["metadata"]["name"]
    admin_kube.delete(f"{path}/{good['metadata']['name']}")


def _served(kube, path: str) -> bool:
    try:
        kube.list(path)
        return True
    except KubeError:
        return False


def test_statefulset_makes_pods_and_gc_collects_them(admin_kube):
    name = f"sts-{random.randrange(10**6)}"
    labels = {"app": name}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name},
           "spec": {"serviceName": name, "replicas": 2, "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": labels},
                                 "spec": {"containers": [{"name": "c", "image": "none", "command": ["true"]}]}}}}
    created = admin_kube.create("/apis/apps/v1/namespaces/default/statefulsets", sts)
    pods = _wait(lambda: [p for p in admin_kube.list("/api/v1/namespaces/default/pods", labelSelector=f"app={name}")]
                 if len(admin_kube.list("/api/v1/namespaces/default/pods", labelSelector=f"app={name}")) == 2 else None,
                 60, "StatefulSet controller made no 2 pods")
    for pod in pods:
        owner = pod["metadata"]["ownerReferences"][0]
        assert owner["uid"] == created["metadata"]["uid"]
        assert pod["metadata"]["labels"]["apps.kubernetes.io/pod-index"] in ("0", "1")
    admin_kube.delete(f"/apis/apps/v1/namespaces/default/statefulsets/{name}", propagationPolicy="Background")
    # No kubelet: the collector's deletes leave pods terminating; force them away like a kubelet would.
    def gone():
        left = admin_kube.list("/api/v1/namespaces/default/pods", labelSelector=f"app={name}")
        for pod in left:
            if pod["metadata"].get("deletionTimestamp"):
                admin_kube.delete(f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}", gracePeriodSeconds=0)
        return not left
    _wait(gone, 60, "garbage collector left the pods")
