"""What a user runs, against the real control plane, with pods under the process kubelet:

    helm install deepseek charts/          the operator's Deployment runs as the chart's
                                           ServiceAccount, with the chart's RBAC and nothing more
    kubectl apply -f examples/cpu-minimal.yaml
    -> StatefulSets, Services, the router come up; the router's Service answers a streamed
       request with the offline engine's greedy tokens

then, on the same deployment: /v1/chat/completions answered with the offline engine's greedy
tokens of the chat-templated prompt, a worker's process killed (the kubelet restarts it, the
operator recreates its group, requests recover), decode scaled 1 -> 2, a new image tag rolled
(refused by the node's registry until pushed, then one group at a time, requests recover with the
same tokens), a bad spec refused by the apiserver with the CRD's CEL message, the V3/H200 example
reported (not crash-looping) on a node without GPUs, and the deletion of the resource removing
every child. Last, the audit log shows the
operator was never denied anything. The tests run in file order on one module fixture.
Debugging: K8SE2E_HOLD=SECONDS keeps the cluster up that long after a failed request (pod logs are
under <basetemp>/kubelet0/pods/<uid>/logs; pass --basetemp, other runs rotate /tmp/pytest-of-*).
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import random
import signal
import time

import aiohttp
import pytest
import yaml
from e2e_deployment import CR_API, NS, OPS, Deployment, run_tool
from e2e_example import apply as _apply, example as _example
from e2e_example import greedy_through_router as _greedy_through_router
from pdtest.waiting import wait_until

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]
RESYNC_S = 1  # the operator's resync (s): what it must leave alone is watched over three of its passes


@pytest.fixture(scope="module")
def deployment(control_plane, admin_kube, process_kubelet, tmp_path_factory):
    out = run_tool("bash", ROOT / "scripts" / "fetch_k8s_tools.sh", timeout=170)
    tools = pathlib.Path(out.stdout.strip().splitlines()[-1])
    workdir = tmp_path_factory.mktemp("operator-e2e")
    kubeconfig = control_plane.admin.kubeconfig(workdir / "admin.kubeconfig", "admin")
    dep = Deployment(admin_kube, process_kubelet, tools, kubeconfig, workdir)
    # The operator watches NS only (the chart's default RBAC is a Role there), so NS exists first.
    dep.kubectl_run("create", "namespace", NS)
    run_tool(dep.helm, "install", "deepseek", ROOT / "charts", "--namespace", OPS, "--create-namespace",
             f"--kubeconfig={kubeconfig}", "--set", f"operator.resyncSeconds={RESYNC_S}",
             "--set", f"operator.watchNamespaces={{{NS}}}", "--wait", "--timeout", "180s")
    wait_until(lambda: admin_kube.get(f"/api/v1/namespaces/{NS}/serviceaccounts/default"), 30, "no default SA")
    yield dep
    dep.kubectl_run("delete", "namespace", NS, "--wait=false", check=False)
    run_tool(dep.helm, "uninstall", "deepseek", "--namespace", OPS, f"--kubeconfig={kubeconfig}", check=False)


def test_helm_install_runs_the_operator_as_the_charts_service_account(deployment):
    pods = deployment.kube.list(f"/api/v1/namespaces/{OPS}/pods")
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    operator = pods[0]
    assert operator["spec"]["containers"][0]["args"][:2] == ["operator", "run"]
    ready = {c["type"]: c["status"] for c in operator["status"]["conditions"]}
    assert ready["Ready"] == "True", deployment.diagnose()
    assert f"--namespace={NS}" in operator["spec"]["containers"][0]["args"]
    account = {"kind": "ServiceAccount", "name": operator["spec"]["serviceAccountName"], "namespace": OPS}
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    cluster_roles = [b["roleRef"]["name"] for b in deployment.kube.list(f"{rbac}/clusterrolebindings")
                     if account in (b.get("subjects") or [])]
    assert cluster_roles == ["deepseek-deepseek-pd-discovery"]  # read-only; writes only through NS's Role
    roles = [b["roleRef"] for b in deployment.kube.list(f"{rbac}/namespaces/{NS}/rolebindings")
             if account in (b.get("subjects") or [])]
    assert [(r["kind"], r["name"]) for r in roles] == [("Role", "deepseek-deepseek-pd-manager")]


def test_example_serves_the_offline_engines_tokens(deployment, models, offline_engine):
    _apply(deployment, _example(models))
    cr = deployment.wait_phase("Available")
    assert cr["status"]["routerReadyReplicas"] >= 1
    roles = {p["metadata"]["labels"]["deepseek-pd.io/role"] for p in deployment.pods("deepseek-pd.io/role")}
    assert roles == {"prefill", "decode"}
    _greedy_through_router(deployment, offline_engine)


def test_router_answers_chat_completions_with_the_offline_engines_tokens(deployment, models, offline_engine):
    from transformers import AutoTokenizer

    from pdtest.gateway_oracle import chat_prompt_ids, offline_greedy, post_json, post_stream, random_words, same_text

    tokenizer = AutoTokenizer.from_pretrained(str(models / "tiny"))
    rng = random.Random()
    url = f"{deployment.router_url()}/v1/chat/completions"
    for stream in (False, True):
        messages = [{"role": "user", "content": random_words(rng, rng.randint(2, 10))}]
        prompt = chat_prompt_ids(tokenizer, messages)  # what the router renders from the chat template
        max_new = rng.randint(3, 8)
        want, _ = offline_greedy(offline_engine, prompt, max_new)
        body = {"model": "tiny", "messages": messages, "max_tokens": max_new, "temperature": 0.0,
                "ignore_eos": True, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}

        async def call():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                return await (post_stream(session, url, body) if stream else post_json(session, url, body))
        reply = asyncio.run(call())
        assert reply.status == 200, f"{reply.text}\n{deployment.diagnose()}"
        if stream:
            content = "".join((c.get("delta") or {}).get("content") or "" for e in reply.events
                              for c in e.get("choices") or [])
            usage = next(e["usage"] for e in reversed(reply.events) if e.get("usage"))
        else:
            content, usage = reply.body["choices"][0]["message"]["content"], reply.body["usage"]
        assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == max_new, usage
        assert same_text(content, want, offline_engine), (stream, content, offline_engine.tokenizer.decode(want))


def test_killed_worker_process_recreates_its_group_and_requests_recover(deployment, offline_engine):
    selector = f"deepseek-pd.io/deployment={deployment.name},deepseek-pd.io/role=decode"
    (pod,) = deployment.pods(selector)
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
    os.kill(pid, signal.SIGKILL)  # what an OOM kill looks like to the kubelet
    old_uid = pod["metadata"]["uid"]

    def replaced():
        pods = deployment.pods(selector)
        return pods if pods and all(p["metadata"]["uid"] != old_uid for p in pods) else None
    wait_until(replaced, 120, "the operator did not recreate the decode group", deployment.diagnose)
    deployment.wait_phase("Available", where=lambda cr: cr["status"]["decode"]["readyReplicas"] == 1)
    _greedy_through_router(deployment, offline_engine, count=2, recover_s=60)


def test_scale_decode_to_two_groups(deployment, offline_engine):
    deployment.kube.merge_patch(f"{CR_API}/namespaces/{NS}/deepseekdeployments/{deployment.name}",
                                {"spec": {"decode": {"replicas": 2}}})
    deployment.wait_phase("Available", where=lambda cr: cr["status"]["decode"]["readyReplicas"] == 2)
    groups = {p["metadata"]["labels"]["deepseek-pd.io/group-index"] for p in
              deployment.pods(f"deepseek-pd.io/deployment={deployment.name},deepseek-pd.io/role=decode")}
    assert groups == {"0", "1"}
    routers = deployment.pods(f"deepseek-pd.io/deployment={deployment.name},app.kubernetes.io/component=router")
    args = [a for p in routers if not p["metadata"].get("deletionTimestamp")
            for a in p["spec"]["containers"][0]["args"]]
    assert sum(a.startswith("grpc://tiny-decode-1-0.") for a in args) >= 1  # the router serves it
    _greedy_through_router(deployment, offline_engine, count=4, recover_s=60)


def test_rolling_a_new_image_tag_replaces_one_group_at_a_time(deployment, offline_engine):
    """The new tag is applied before it is pushed: the first groups replaced cannot pull it, the
    rollout stops there (the other decode group kept, the resource saying why); once pushed, the
    decode groups roll one at a time (maxUnavailable 1 of 2) and requests get the same tokens."""
    from group_rollout import GROUP_INDEX, GroupWatch, replacement_order
    from image_registry import made_images

    path = f"{CR_API}/namespaces/{NS}/deepseekdeployments/{deployment.name}"
    old = deployment.cr()["spec"]["image"]
    repo, flavour = old.rsplit(":", 1)[0], old.rsplit("-", 1)[1]  # ...:0.1.0-cpu -> "cpu"
    tag = f"0.1.{random.randrange(1, 10**6)}"
    new = f"{repo}:{tag}-{flavour}"
    assert old in made_images() and new in made_images(f"IMAGE_TAG={tag}")  # what `make image` tags
    watch = GroupWatch(deployment.kube, NS, deployment.name, "decode", size=1)
    assert {g for g, (ready, _) in watch.sample().items() if ready} == {0, 1}
    old_uids = {p["metadata"]["uid"] for p in watch.pods()}
    deployment.kube.merge_patch(path, {"spec": {"image": new}})

    def pull_failing():  # the `model` init container is the first to pull
        watch.sample()
        pods = [p for p in watch.pods() if p["spec"]["containers"][0]["image"] == new]
        statuses = [c for p in pods for kind in ("initContainerStatuses", "containerStatuses")
                    for c in (p.get("status") or {}).get(kind) or []]
        reasons = {(c.get("state") or {}).get("waiting", {}).get("reason") for c in statuses}
        return pods if reasons & {"ErrImagePull", "ImagePullBackOff"} else None
    stuck = wait_until(pull_failing, 120, "no decode pod of the unpushed tag failed to pull", deployment.diagnose)
    assert len({p["metadata"]["labels"][GROUP_INDEX] for p in stuck}) == 1
    for _ in range(6 * RESYNC_S):  # three resyncs: nothing more is replaced while that group is down
        sample = watch.sample()
        time.sleep(0.5)
    assert sum(new in images for _, images in sample.values()) == 1, sample
    assert [ready for ready, images in sample.values() if new not in images] == [True], sample
    assert len(old_uids & {p["metadata"]["uid"] for p in watch.pods()}) == 1
    status = deployment.cr()["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Progressing"]["status"] == "True", conditions
    assert status["phase"] == "Degraded" and conditions["Degraded"]["reason"] == "ModelNotReady", status
    # The resource says why: the kubelet's pull error, naming the tag (operator/model_status.py).
    model = conditions["ModelReady"]
    assert model["status"] == "False" and model["reason"] in ("ErrImagePull", "ImagePullBackOff"), model
    assert new in model["message"], model

    deployment.kubelet.registry.push(*made_images(f"IMAGE_TAG={tag}"))  # `make image image-push`

    def rolled():
        sample = watch.sample()
        return set(sample) == {0, 1} and all(ready and images == {new} for ready, images in sample.values())
    wait_until(rolled, 420, f"the decode groups did not all roll to {new}", deployment.diagnose)
    assert watch.min_ready >= 1, watch.samples  # never both decode groups down
    first, second = replacement_order(watch.pods(), new)
    assert second[1] >= first[2], (first, second)  # the second was replaced once the first was Ready
    # The first new group answered the verification's greedy requests as the old group did
    # (same model: the check is on by default), which let the rollout go on; the second had no
    # old group left to compare with.
    events = deployment.kube.list(f"/api/v1/namespaces/{NS}/events",
                                  fieldSelector=f"involvedObject.name={deployment.name}")
    verified = [e["message"] for e in events if e.get("reason") == "GroupVerified"]
    assert any(m.startswith(f"decode group {first[0]} ") for m in verified), (first, verified)
    assert not [e for e in events if e.get("reason") == "TokensDiffer"], events
    deployment.wait_phase("Available", where=lambda cr: cr["status"]["decode"]["updatedReplicas"] == 2
                          and cr["status"]["prefill"]["updatedReplicas"] == 1)

    def all_on_the_new_tag():  # prefill and the router too (the router Deployment rolls by itself)
        pods = [p for p in deployment.pods() if not p["metadata"].get("deletionTimestamp")]
        statuses = [(p.get("status") or {}).get("containerStatuses") or [{"ready": False}] for p in pods]
        return all(c["image"] == new for p in pods for c in p["spec"]["containers"]) and \
            all(c["ready"] for s in statuses for c in s)
    wait_until(all_on_the_new_tag, 120, f"pods not all Ready on {new}", deployment.diagnose)
    _greedy_through_router(deployment, offline_engine, count=3, recover_s=60)


def test_bad_spec_is_refused_with_the_crds_message(deployment, models):
    from deepseek_pd.operator.crd import crd_yaml

    bad = _example(models)
    bad["metadata"]["name"] = "bad-experts"
    bad["spec"]["model"]["numRoutedExperts"] = 7
    bad["spec"]["decode"]["parallelism"] = {"tp": 1, "dp": 2, "ep": 2}
    out = _apply(deployment, bad, check=False)
    assert out.returncode != 0
    message = "decode.parallelism.ep must divide model.numRoutedExperts"
    assert message in crd_yaml() and message in out.stderr, out.stderr
    assert deployment.kube.get(f"{CR_API}/namespaces/{NS}/deepseekdeployments/bad-experts") is None


def test_v3_example_is_reported_not_crash_looping_without_gpus(deployment):
    v3 = yaml.safe_load((ROOT / "examples" / "deepseek-v3-h200.yaml").read_text())
    _apply(deployment, v3)
    name = v3["metadata"]["name"]
    # The workers ask for GPUs and H200 nodes; the router (CPU only) may run, and waits for them.
    selector = f"deepseek-pd.io/deployment={name},deepseek-pd.io/role"

    def pending_pods():
        pods = deployment.kube.list(f"/api/v1/namespaces/{NS}/pods", labelSelector=selector)
        unschedulable = [p for p in pods if any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                                                for c in p["status"].get("conditions", []))]
        return pods if len(pods) == expected and len(unschedulable) == len(pods) else None
    expected = sum(v3["spec"][r]["replicas"] * v3["spec"][r]["size"] for r in ("prefill", "decode"))
    pods = wait_until(pending_pods, 120, "V3 pods are not all Unschedulable", deployment.diagnose)
    assert all(not p["spec"].get("nodeName") for p in pods)
    def explained():
        c = deployment.kube.get(f"{CR_API}/namespaces/{NS}/deepseekdeployments/{name}") or {}
        return c if any(x.get("reason") == "PodsUnschedulable" for x in (c.get("status") or {}).get("conditions", [])) else None
    cr = wait_until(explained, 60, "V3 status does not say its pods are unschedulable", deployment.diagnose)
    conditions = {c["type"]: c for c in cr["status"]["conditions"]}
    assert cr["status"]["phase"] in ("Pending", "Failed"), cr["status"]
    assert conditions["Available"]["status"] == "False"
    # The scheduler's own reason reaches the resource's status (operator/pod_scheduling.py).
    scheduler_says = {c["message"] for p in pods for c in p["status"]["conditions"] if c["type"] == "PodScheduled"}
    assert conditions["Available"]["reason"] == "PodsUnschedulable", conditions["Available"]
    assert any(m in conditions["Available"]["message"] for m in scheduler_says), conditions["Available"]
    time.sleep(3 * RESYNC_S)  # three resyncs: nothing restarts, nothing is recreated
    again = deployment.kube.list(f"/api/v1/namespaces/{NS}/pods", labelSelector=selector)
    assert {p["metadata"]["uid"] for p in again} == {p["metadata"]["uid"] for p in pods}
    deployment.kubectl_run("delete", "-n", NS, "deepseekdeployment", name, "--wait=true", "--timeout=120s")


def test_deleting_the_resource_removes_every_child(deployment):
    selector = f"deepseek-pd.io/deployment={deployment.name}"
    children = [(kind, path) for kind, path in (
        ("StatefulSet", f"/apis/apps/v1/namespaces/{NS}/statefulsets"),
        ("Deployment", f"/apis/apps/v1/namespaces/{NS}/deployments"),
        ("Service", f"/api/v1/namespaces/{NS}/services"),
        ("ConfigMap", f"/api/v1/namespaces/{NS}/configmaps"),
        ("Pod", f"/api/v1/namespaces/{NS}/pods"))]
    before = {kind: deployment.kube.list(path, labelSelector=selector) for kind, path in children}
    assert before["StatefulSet"] and before["Pod"]
    uid = deployment.cr()["metadata"]["uid"]
    for sts in before["StatefulSet"]:  # owned by the CR, so the garbage collector may collect them
        assert [o["uid"] for o in sts["metadata"]["ownerReferences"]] == [uid]
    pids = [int(c["containerID"].removeprefix("process://")) for p in before["Pod"]
            for c in p["status"]["containerStatuses"] if c.get("containerID")]
    deployment.kubectl_run("delete", "-n", NS, "deepseekdeployment", deployment.name, "--wait=true", "--timeout=120s")

    def all_gone():
        return all(not deployment.kube.list(path, labelSelector=selector) for _, path in children)
    wait_until(all_gone, 120, "children left after the delete", deployment.diagnose)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_operator_was_never_denied(deployment, control_plane):
    account = deployment.kube.list(f"/api/v1/namespaces/{OPS}/pods")[0]["spec"]["serviceAccountName"]
    user = f"system:serviceaccount:{OPS}:{account}"
    events = [json.loads(line) for line in control_plane.audit_log.read_text().splitlines() if line.strip()]
    mine = [e for e in events if e.get("user", {}).get("username") == user]
    assert len(mine) > 20, "the audit log holds no requests of the operator"
    denied = [(e["verb"], e["requestURI"], e["responseStatus"].get("code")) for e in mine
              if e.get("responseStatus", {}).get("code") == 403]
    assert not denied, denied
