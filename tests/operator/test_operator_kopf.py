"""The real kopf operator against an emulated API server (kmock + fixes), end to end.

No controller runs in the emulator, so the tests play the StatefulSet controller and the kubelet:
they create the pods a StatefulSet would create and set their status. Every wait is bounded.
"""
from __future__ import annotations

import copy
import pathlib
import random
import time

import kmock
import pytest
import yaml
from kopf_log import object_log
from leader_urls import leader_urls, router_worker_urls

from deepseek_pd.operator import names

pytestmark = [pytest.mark.timeout(120)]
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
# With the default router.workerDiscovery Static the router gets no Role: it never reads the API.
ROUTER_KINDS = ("ServiceAccount", "Deployment", "Service")


def _deployment(name: str, **decode: object) -> dict:
    body = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": "llm"}
    body["spec"]["decode"].update(decode)
    return body


def _status(cluster, name: str) -> dict:
    return (cluster.get(names.KIND, name) or {}).get("status") or {}


def _condition(cluster, name: str, type_: str) -> dict:
    return next((c for c in _status(cluster, name).get("conditions", []) if c["type"] == type_), {})


def _statefulset(cluster, name: str, role: str, index: int) -> dict | None:
    return cluster.get("StatefulSet", names.group_name(name, role, index))


def _revision(sts: dict | None) -> str | None:
    return None if sts is None else sts["metadata"]["annotations"][names.ANNOTATION_REVISION]


def _start_pods(cluster, sts: dict, *, ready: bool = True) -> list[str]:
    """What the StatefulSet controller and kubelet would do: one Running pod per rank."""
    template = sts["spec"]["template"]
    created = []
    for rank in range(sts["spec"]["replicas"]):
        labels = {**template["metadata"]["labels"], names.LABEL_POD_INDEX: str(rank)}
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{sts['metadata']['name']}-{rank}", "namespace": "llm",
                         "labels": labels, "annotations": template["metadata"]["annotations"]},
            "spec": copy.deepcopy(template["spec"]),
            "status": {"phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "worker", "ready": ready, "restartCount": 0}]},
        }
        cluster.create(pod)
        created.append(pod["metadata"]["name"])
    return created


def _router_ready(cluster, name: str) -> None:
    cluster.patch("Deployment", names.router_name(name), {"status": {"readyReplicas": 1}}, "status")


def _router_rolled_out(cluster, name: str) -> None:
    """What the Deployment controller reports once every router pod runs the current template."""
    router = cluster.get("Deployment", names.router_name(name))
    replicas = router["spec"]["replicas"]
    cluster.patch("Deployment", names.router_name(name), {"status": {
        "observedGeneration": router["metadata"]["generation"], "replicas": replicas,
        "updatedReplicas": replicas, "readyReplicas": replicas}}, "status")


def _full_pass(cluster, name: str) -> None:
    """Returns once a whole reconcile pass has started after this call: the pass that recreates a
    deleted child observed the cluster after the deletion (passes of one object are serialised)."""
    witness = names.config_map_name(name, "prefill")
    cluster.delete("ConfigMap", witness)
    cluster.wait_for("a reconcile pass", lambda: cluster.get("ConfigMap", witness))


def _bring_up(cluster, name: str, groups: dict[str, int]) -> None:
    for role, count in groups.items():
        for index in range(count):
            sts = cluster.wait_for(f"{role} group {index}", lambda: _statefulset(cluster, name, role, index))
            _start_pods(cluster, sts)
    _router_ready(cluster, name)
    cluster.wait_for("phase Available", lambda: _status(cluster, name).get("phase") == "Available")


def test_create_builds_every_child_owned_by_the_resource(cluster):
    name = "create"
    cluster.create(_deployment(name))
    owner_uid = cluster.wait_for("the CR", lambda: cluster.get(names.KIND, name))["metadata"]["uid"]
    expected = {("ConfigMap", names.config_map_name(name, r)) for r in names.ROLES}
    expected |= {(k, names.router_name(name)) for k in ROUTER_KINDS}
    expected |= {(k, names.group_name(name, r, 0)) for r in names.ROLES for k in ("StatefulSet", "Service")}
    for kind, child in sorted(expected):
        obj = cluster.wait_for(f"{kind} {child}", lambda: cluster.get(kind, child))
        refs = obj["metadata"].get("ownerReferences", [])
        assert [(r["uid"], r["kind"], r.get("controller")) for r in refs] == [(owner_uid, names.KIND, True)]

    sts = _statefulset(cluster, name, "prefill", 0)
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["serviceName"] == names.group_name(name, "prefill", 0)
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LWS_LEADER_ADDRESS"]["value"] == names.leader_address(name, "prefill", 0, "llm")
    assert env["LWS_GROUP_SIZE"]["value"] == "1"
    service = cluster.get("Service", names.group_name(name, "decode", 0))
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert not {n for k in ("Role", "RoleBinding") for n in cluster.names(k) if n.startswith(f"{name}-")}

    body = cluster.wait_for("status", lambda: _status(cluster, name).get("phase") and cluster.get(names.KIND, name))
    assert f"{names.GROUP}/finalizer" in body["metadata"]["finalizers"]
    status = body["status"]
    assert status["phase"] == "Pending" and status["observedGeneration"] == 1
    assert status["routerEndpoint"] == f"http://{names.router_name(name)}.llm.svc:8000"
    assert status["decode"]["replicas"] == 1 and status["decode"]["readyReplicas"] == 0
    # Only the documented fields: no kopf handler results under status.
    assert set(status) <= {"phase", "conditions", "observedGeneration", "prefill", "decode",
                           "routerEndpoint", "routerReadyReplicas"}

    _bring_up(cluster, name, {"prefill": 1, "decode": 1})
    assert _condition(cluster, name, "Available")["status"] == "True"


def _router_urls_follow_groups(cluster, name: str, decode_groups: int) -> bool:
    """The router was given exactly the leaders of the groups that exist, over gRPC."""
    children = [o for kind in ("StatefulSet", "Service") for o in cluster.list(kind)
                if o["metadata"].get("labels", {}).get(names.LABEL_DEPLOYMENT) == name]
    router = cluster.get("Deployment", names.router_name(name))
    if router is None:
        return False
    urls = router_worker_urls(router)
    return len(urls["decode"]) == decode_groups and \
        urls == {role: leader_urls(children, role) for role in names.ROLES}


def test_scaling_adds_and_removes_whole_groups(cluster):
    name = "scale"
    cluster.create(_deployment(name, replicas=1))
    cluster.wait_for("decode group 0", lambda: _statefulset(cluster, name, "decode", 0))
    cluster.wait_for("router lists 1 decode group", lambda: _router_urls_follow_groups(cluster, name, 1))
    target = random.randint(2, 4)
    cluster.patch(names.KIND, name, {"spec": {"decode": {"replicas": target}}})
    wanted = {names.group_name(name, "decode", i) for i in range(target)}
    cluster.wait_for(f"{target} decode groups", lambda: wanted <= cluster.names("StatefulSet")
                     and wanted <= cluster.names("Service"))
    cluster.wait_for(f"router lists {target} decode groups",
                     lambda: _router_urls_follow_groups(cluster, name, target))

    cluster.patch(names.KIND, name, {"spec": {"decode": {"replicas": 1}}})
    extra = wanted - {names.group_name(name, "decode", 0)}
    cluster.wait_for("router drops the retired groups",
                     lambda: len(router_worker_urls(cluster.get("Deployment", names.router_name(name)))["decode"]) == 1)
    # The old router pods may still send to the retired groups: they stay until the rollout is done.
    for _ in range(2):
        _full_pass(cluster, name)
        assert extra <= cluster.names("StatefulSet") and extra <= cluster.names("Service")
    _router_rolled_out(cluster, name)
    cluster.wait_for("scale-down", lambda: not (extra & (cluster.names("StatefulSet") | cluster.names("Service"))))
    assert _statefulset(cluster, name, "decode", 0) is not None
    cluster.wait_for("router lists 1 decode group again", lambda: _router_urls_follow_groups(cluster, name, 1))
    cluster.wait_for("status follows", lambda: _status(cluster, name).get("decode", {}).get("replicas") == 1)


def test_image_change_rolls_one_group_at_a_time(cluster):
    name = "roll"
    # The greedy check of new groups needs real workers (test_rollout_verify.py, test_rollout_gate.py).
    cluster.create(_deployment(name, replicas=2, size=2, rolloutStrategy={"verify": False}))
    _bring_up(cluster, name, {"prefill": 1, "decode": 2})
    old = _revision(_statefulset(cluster, name, "decode", 0))
    old_prefill = _revision(_statefulset(cluster, name, "prefill", 0))

    cluster.patch(names.KIND, name, {"spec": {"image": "ghcr.io/deepseek-pd/deepseek-pd:next"}})

    def replaced() -> list[int]:
        return [i for i in range(2) if _revision(_statefulset(cluster, name, "decode", i)) not in (old, None)]

    first = cluster.wait_for("the first group to be replaced", replaced)
    assert len(first) == 1
    cluster.wait_for("phase Progressing", lambda: _status(cluster, name).get("phase") == "Progressing")
    # While the new group is not ready, maxUnavailable=1 keeps the other group on the old revision.
    for _ in range(2):
        _full_pass(cluster, name)
        assert replaced() == first
    sts = _statefulset(cluster, name, "decode", first[0])
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":next")
    replaced_pods = {names.pod_name(name, "decode", first[0], r) for r in range(2)}
    cluster.wait_for("old pods of the group deleted", lambda: not (replaced_pods & cluster.names("Pod")))

    _start_pods(cluster, sts)
    cluster.wait_for("the second group to be replaced", lambda: len(replaced()) == 2)
    second = 1 - first[0]
    _start_pods(cluster, _statefulset(cluster, name, "decode", second))
    # The image is shared, so the prefill group rolled as well (its only group: maxUnavailable=1).
    prefill = cluster.wait_for("prefill replaced", lambda: _revision(
        _statefulset(cluster, name, "prefill", 0)) not in (old_prefill, None)
        and _statefulset(cluster, name, "prefill", 0))
    cluster.wait_for("old prefill pod deleted", lambda: names.pod_name(name, "prefill", 0, 0) not in cluster.names("Pod"))
    _start_pods(cluster, prefill)
    cluster.wait_for("Available again", lambda: _status(cluster, name).get("phase") == "Available")
    status = _status(cluster, name)["decode"]
    assert status["updatedReplicas"] == status["readyReplicas"] == 2
    new = _revision(_statefulset(cluster, name, "decode", 0))
    decode_pods = [p for p in cluster.list("Pod") if p["metadata"]["name"].startswith(f"{name}-decode-")]
    assert len(decode_pods) == 4
    assert {p["metadata"]["labels"][names.LABEL_REVISION] for p in decode_pods} == {new}


def test_failed_pod_recreates_its_whole_group(cluster):
    name = "gang"
    cluster.create(_deployment(name, size=2))
    _bring_up(cluster, name, {"prefill": 1, "decode": 1})
    pods = [names.pod_name(name, "decode", 0, r) for r in range(2)]
    victim = random.choice(pods)
    cluster.patch("Pod", victim, {"status": {"phase": "Failed"}}, "status")
    cluster.wait_for("every pod of the group deleted", lambda: not (set(pods) & cluster.names("Pod")))
    assert _statefulset(cluster, name, "decode", 0) is not None  # the group itself stays
    assert names.pod_name(name, "prefill", 0, 0) in cluster.names("Pod")  # other groups untouched
    degraded = cluster.wait_for("Degraded", lambda: _condition(cluster, name, "Degraded").get("status") == "True"
                                and _condition(cluster, name, "Degraded"))
    assert degraded["reason"] in ("GroupRestarted", "GroupsNotReady")
    _start_pods(cluster, _statefulset(cluster, name, "decode", 0))
    cluster.wait_for("Available", lambda: _status(cluster, name).get("phase") == "Available")


def test_restart_policy_none_leaves_the_group_alone(cluster):
    name = "nogang"
    cluster.create(_deployment(name, size=2, restartPolicy="None"))
    _bring_up(cluster, name, {"prefill": 1, "decode": 1})
    victim = names.pod_name(name, "decode", 0, 1)
    cluster.patch("Pod", victim, {"status": {"containerStatuses": [
        {"name": "worker", "ready": True, "restartCount": 1}]}}, "status")
    for _ in range(2):  # full passes that saw the restart: nothing is deleted
        _full_pass(cluster, name)
        assert {victim, names.pod_name(name, "decode", 0, 0)} <= cluster.names("Pod")


def test_invalid_spec_becomes_a_condition_and_recovers(cluster):
    name = "invalid"
    body = _deployment(name)
    body["spec"]["decode"]["parallelism"] = {"tp": 2, "dp": 2}  # 4 ranks on a 1-pod CPU group
    cluster.create(body)
    cond = cluster.wait_for("InvalidSpec", lambda: _condition(cluster, name, "InvalidSpec").get("status") == "True"
                            and _condition(cluster, name, "InvalidSpec"))
    assert "spec.decode.parallelism" in cond["message"]
    assert _status(cluster, name)["phase"] == "Failed"
    assert not {s for s in cluster.names("StatefulSet") if s.startswith(f"{name}-")}

    cluster.patch(names.KIND, name, {"spec": {"decode": {"parallelism": {"tp": 1, "dp": 1}}}})
    cluster.wait_for("children after the fix", lambda: _statefulset(cluster, name, "decode", 0))
    cluster.wait_for("InvalidSpec cleared",
                     lambda: _condition(cluster, name, "InvalidSpec").get("status") == "False")


def test_delete_runs_the_finalizer_and_removes_children(cluster):
    name = "delete"
    cluster.create(_deployment(name))
    cluster.wait_for("children", lambda: _statefulset(cluster, name, "decode", 0))
    _start_pods(cluster, _statefulset(cluster, name, "decode", 0))
    cluster.delete(names.KIND, name)
    cluster.wait_for("the CR to go", lambda: cluster.get(names.KIND, name) is None)
    for kind in ("StatefulSet", "Service", "ConfigMap", "Deployment", "Role", "RoleBinding",
                 "ServiceAccount", "Pod"):
        assert not {n for n in cluster.names(kind) if n.startswith(f"{name}-")}, kind


def _settled(cluster, name: str) -> bool:
    """No write to the CR over three resync intervals: the next pass writes nothing either."""
    before = cluster.get(names.KIND, name)["metadata"]["resourceVersion"]
    time.sleep(3 * cluster.resync_seconds)
    return cluster.get(names.KIND, name)["metadata"]["resourceVersion"] == before


def test_a_deletion_during_a_resync_pass_removes_the_cr_once_the_pass_ends(cluster):
    """kopf stops an object's timers when it is deleted and keeps its finalizer until they have
    exited. A resync pass under way cannot stop at once; when it then wrote no status (so no watch
    event woke kopf), kopf looked again only after its default 60 s cancellation polling and the CR
    stayed a minute (CI: "timed out after 30.0s waiting for the CR to go"). Here a pass is held in
    its listing of the children until kopf has seen the deletion."""
    name = f"midpass{random.randint(0, 9999)}"
    cluster.create(_deployment(name))
    cluster.wait_for("children", lambda: _statefulset(cluster, name, "decode", 0))
    cluster.wait_for("a settled status", lambda: _settled(cluster, name))
    selector = names.selector_string({names.LABEL_DEPLOYMENT: name})
    hold = cluster.hold_next(lambda r: r.action == kmock.action.LIST and r.resource.plural == "statefulsets"
                             and r.params.get("labelSelector") == selector)
    try:
        cluster.wait_for("a resync pass", hold.arrived.is_set)
        with object_log(name) as log:
            cluster.delete(names.KIND, name)
            # Logged after kopf stopped the timers, before the deletion handler (which waits for the pass).
            cluster.wait_for("kopf to see the deletion",
                             lambda: any(m.startswith("Deletion is in progress") for m in log))
    finally:
        cluster.release(hold)
    cluster.wait_for("the CR to go", lambda: cluster.get(names.KIND, name) is None)
    for kind in ("StatefulSet", "Service", "ConfigMap", "Deployment"):
        assert not {n for n in cluster.names(kind) if n.startswith(f"{name}-")}, kind


def test_check_command_reads_the_crd_through_a_kubeconfig(cluster, tmp_path, monkeypatch, capsys):
    """`deepseek-pd operator check` (the helm test) with kopf's kubeconfig login, then a failure."""
    from deepseek_pd.cli import main

    def kubeconfig(server: str) -> str:
        path = tmp_path / f"config-{abs(hash(server))}"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": server}}],
            "users": [{"name": "tester", "user": {"token": "t"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
        }))
        return str(path)

    cluster.create(_deployment("checked"))
    monkeypatch.setenv("KUBECONFIG", kubeconfig(cluster.url))
    assert main(["operator", "check", "--namespace", "llm"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {names.CRD_NAME} is served;") and " in namespace llm" in out
    count = int(out.split(";")[1].split()[0])
    assert count == len(cluster.list(names.KIND))

    monkeypatch.setenv("KUBECONFIG", kubeconfig("http://127.0.0.1:1"))  # nothing listens there
    assert main(["operator", "check", "--namespace", "llm"]) == 2
    assert "cannot list deepseekdeployments in llm" in capsys.readouterr().err


def test_a_stale_json_patch_is_refused_as_the_api_server_refuses_it(cluster):
    """kopf removes its finalizer by a JSON patch that first tests metadata.resourceVersion, and
    retries on the next event only when the server answers 422 (kube-apiserver's answer to a failed
    `test`). The emulator answered 409, which kopf throttles instead, dropping the events of the
    throttle window: under load a deletion raced by a status write then never finished."""
    import urllib.error

    name = f"stale{random.randint(0, 9999)}"
    cluster.create(_deployment(name))
    before = cluster.wait_for("the CR", lambda: cluster.get(names.KIND, name))
    stale = str(int(before["metadata"]["resourceVersion"]) - random.randint(1, 50))
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": stale},
           {"op": "add", "path": "/metadata/labels", "value": {"stale": "write"}}]
    with pytest.raises(urllib.error.HTTPError) as refused:
        cluster._request("PATCH", cluster.path(names.KIND, name), ops, "application/json-patch+json")
    assert refused.value.code == 422
    assert "stale" not in (cluster.get(names.KIND, name)["metadata"].get("labels") or {})
    cluster.delete(names.KIND, name)
    cluster.wait_for("the CR to go", lambda: cluster.get(names.KIND, name) is None)
