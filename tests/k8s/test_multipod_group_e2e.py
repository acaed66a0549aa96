"""The installed chart and a two-pod group, against the real control plane and the live operator:

    helm install multipod charts/          (its own release and namespaces, beside the operator e2e's)
    helm test multipod                     the chart's test pod runs `operator check` as the
                                           operator's ServiceAccount, and passes
    kubectl apply  V3 on one node in bf16  the live operator writes MemoryPlanFits False, phase
                                           Failed, and creates no child
    kubectl apply  cpu-minimal, decode of `size: 2` (dp 2, ep 2: one rank per pod, the operator's
                   --nnodes/--node-rank/--dist-init-addr from the LWS env), gang-scheduled by the
                   real kube-scheduler on the node whose kubelet runs it: wholly Pending while a
                   blocker pod leaves CPU for one rank, then bound, Running and serving once it goes
    -> the router answers with the offline engine's greedy tokens; every worker pod's metrics port
       and the router's metrics Service port count what was sent
    SIGKILL of the follower pod's worker -> both pods of the group recreated (new UIDs), requests
       recover with the same tokens

The tests run in file order on one module fixture.
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import yaml
from e2e_deployment import CR_API, installed_release, run_tool
from e2e_example import ROOT, apply, example, greedy_through_router
from pod_metrics import metrics_url, scrape, total
from pdtest.pod_inputs import quantity
from pdtest.waiting import wait_until

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
RELEASE, OPS, NS = "multipod", "ops-mp", "llm-mp"
RESYNC_S = 1  # the operator's resync (s): what it must not do is watched over three of its passes
POD_INDEX = "apps.kubernetes.io/pod-index"
MAX_NEW = 8  # new tokens per metered request


@pytest.fixture(scope="module")
def deployment(control_plane, admin_kube, process_kubelet, tmp_path_factory):
    with installed_release(control_plane, admin_kube, process_kubelet, tmp_path_factory.mktemp("multipod-e2e"),
                           RELEASE, OPS, NS, "--set", f"operator.resyncSeconds={RESYNC_S}") as dep:
        yield dep


def _worker_pods(dep, role: str) -> list[dict]:
    pods = dep.pods(f"deepseek-pd.io/deployment={dep.name},deepseek-pd.io/role={role}")
    return sorted((p for p in pods if not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: (p["metadata"]["labels"]["deepseek-pd.io/group-index"], p["metadata"]["name"]))


def _router_metrics_url(dep) -> str:
    """The router Service's `metrics` port, at its ready endpoint (what kube-proxy would send to)."""
    service = dep.kube.get(f"/api/v1/namespaces/{dep.namespace}/services/{dep.name}-router")
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}, service["spec"]["ports"]
    (slice_,) = dep.kube.list(f"/apis/discovery.k8s.io/v1/namespaces/{dep.namespace}/endpointslices",
                              labelSelector=f"kubernetes.io/service-name={dep.name}-router")
    port = next(p["port"] for p in slice_["ports"] if p.get("name") == "metrics")
    address = next(e["addresses"][0] for e in slice_["endpoints"] if e.get("conditions", {}).get("ready"))
    return f"http://{address}:{port}/metrics"


def _scheduled(pod: dict) -> dict:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"), {})


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read().decode().split("\0")[:-1]


def test_helm_test_passes_as_the_operators_account(deployment):
    started = time.monotonic()
    out = run_tool(deployment.helm, "test", RELEASE, "--namespace", OPS, f"--kubeconfig={deployment.kubeconfig}",
                   "--timeout", "120s", timeout=150)
    assert "Phase: Succeeded" in " ".join(out.stdout.split()), out.stdout
    print(f"helm test took {time.monotonic() - started:.1f} s")


def test_live_operator_refuses_a_plan_that_does_not_fit_with_a_condition(deployment):
    """The V3 example on one node in bf16: the CRD accepts it, the operator (the chart's pod, with
    the chart's RBAC) must refuse it: MemoryPlanFits False, phase Failed, and nothing created."""
    v3 = yaml.safe_load((ROOT / "examples" / "deepseek-v3-h200.yaml").read_text())
    name = v3["metadata"]["name"] = "v3-bf16"
    v3["spec"]["model"]["architecture"] = "DeepSeek-V3"
    v3["spec"]["prefill"].update(size=1, parallelism={"tp": 1, "dp": 8, "ep": 8},
                                 engineArgs=["--engine-opt", "fp8_backend=dequant"])
    apply(deployment, v3)
    path = f"{CR_API}/namespaces/{NS}/deepseekdeployments/{name}"

    def refused():
        cr = deployment.kube.get(path) or {}
        status = cr.get("status") or {}
        seen = status.get("observedGeneration") == cr.get("metadata", {}).get("generation")
        return cr if seen and any(c["type"] == "MemoryPlanFits" for c in status.get("conditions") or []) else None
    cr = wait_until(refused, 60, "the operator wrote no MemoryPlanFits condition", deployment.diagnose)
    memory = next(c for c in cr["status"]["conditions"] if c["type"] == "MemoryPlanFits")
    assert (cr["status"]["phase"], memory["status"], memory["reason"]) == ("Failed", "False", "DoesNotFit"), cr
    assert memory["message"], memory
    time.sleep(3 * RESYNC_S)  # three resyncs: still nothing
    for plural in ("apis/apps/v1/{}/statefulsets", "apis/apps/v1/{}/deployments", "api/v1/{}/services",
                   "api/v1/{}/configmaps", "api/v1/{}/pods", "api/v1/{}/secrets"):
        listed = deployment.kube.list("/" + plural.format(f"namespaces/{NS}"))
        children = [o["metadata"]["name"] for o in listed if o["metadata"]["name"].startswith(name)
                    or (o["metadata"].get("labels") or {}).get("deepseek-pd.io/deployment") == name]
        assert not children, (plural, children)
    deployment.kubectl_run("delete", "-n", NS, "deepseekdeployment", name, "--wait=true", "--timeout=60s")


def _cpu_requested(pod: dict) -> float:
    """What the scheduler counts of a pod's CPU: its containers' requests, or its largest init
    container's if that is more."""
    def cpu(containers) -> float:
        return [quantity(((c.get("resources") or {}).get("requests") or {}).get("cpu", "0")) for c in containers or []]
    return max([sum(cpu(pod["spec"]["containers"])), *cpu(pod["spec"].get("initContainers"))])


def _blocker(dep, node: str, leave_cpu: float) -> str:
    """A pod on `node` that takes its CPU but `leave_cpu` (counting every pod still there, and as
    if the terminating ones were gone); its path."""
    allocatable = quantity(dep.kube.get(f"/api/v1/nodes/{node}")["status"]["allocatable"]["cpu"])
    used = sum(_cpu_requested(p) for p in dep.kube.list("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")
               if p["status"].get("phase") not in ("Succeeded", "Failed") and not p["metadata"].get("deletionTimestamp"))
    millicores = int((allocatable - used - leave_cpu) * 1000)
    assert millicores > 0, (allocatable, used)
    dep.kube.create(f"/api/v1/namespaces/{NS}/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "blocker"}, "spec": {
        "nodeName": node, "terminationGracePeriodSeconds": 1, "containers": [{
            "name": "c", "image": "none", "command": ["sleep", "3600"],
            "resources": {"requests": {"cpu": f"{millicores}m"}}}]}})
    return f"/api/v1/namespaces/{NS}/pods/blocker"


def test_two_pod_decode_group_is_a_gang_that_runs_whole_once_room_appears_and_serves(deployment, models, offline_engine,
                                                                          real_scheduler, process_kubelet):
    """Gang scheduling with the real kube-scheduler, on the node whose kubelet runs the pods: a
    blocker pod leaves room for prefill (0.1 CPU) and one decode rank (1 CPU), never both ranks.
    A scheduler placing pod by pod would start rank 0 (and hold its CPU, for nothing); the gang
    starts neither. The blocker deleted, both ranks bind, run, and the group serves."""
    node = process_kubelet.name
    blocker = _blocker(deployment, node, leave_cpu=1.6)
    cr = example(models)
    cr["spec"]["decode"].update(size=2, parallelism={"tp": 1, "dp": 2, "ep": 2})
    cr["spec"]["prefill"]["resources"] = {"requests": {"cpu": "100m", "memory": "2Gi"}}
    cr["spec"]["scheduling"] = {"gang": True, "schedulerName": real_scheduler,
                                "nodeSelector": {"kubernetes.io/hostname": node}}
    apply(deployment, cr)

    def refused() -> bool:
        pods = _worker_pods(deployment, "decode")
        return len(pods) == 2 and all(_scheduled(p).get("reason") == "Unschedulable" for p in pods)
    wait_until(refused, 90, "the real scheduler's Unschedulable verdict on both decode ranks", deployment.diagnose)
    time.sleep(2)  # a rank bound by a pod-by-pod pass would show by now (binds take milliseconds)
    assert [p["metadata"]["name"] for p in _worker_pods(deployment, "decode") if p["spec"].get("nodeName")] == []
    path = f"{CR_API}/namespaces/{NS}/deepseekdeployments/{cr['metadata']['name']}"

    def gang() -> dict:
        status = (deployment.kube.get(path) or {}).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == "GangScheduling"), {})
    waiting = wait_until(lambda: gang().get("reason") == "GangWaitingForRoom" and gang(), 30,
                         "the operator does not say the gang waits for room", deployment.diagnose)
    assert "Insufficient cpu" in waiting["message"], waiting  # kube-scheduler's words

    deployment.kube.delete(blocker)  # room appears: the whole group binds and runs
    deployment.wait_phase("Available", timeout_s=420)
    decode = _worker_pods(deployment, "decode")
    assert all(p["spec"]["nodeName"] == node and p["status"]["phase"] == "Running" for p in decode), decode
    assert gang()["reason"] == "PodGroupsPlaced", gang()
    assert [p["metadata"]["labels"][POD_INDEX] for p in decode] == ["0", "1"], deployment.diagnose()
    leader = decode[0]["spec"]["hostname"] + "." + decode[0]["spec"]["subdomain"]
    for rank, pod in enumerate(decode):  # what the kubelet ran: the operator's flags, the LWS env expanded
        pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
        argv = _cmdline(pid)
        at = argv.index("--nnodes")
        assert argv[at:at + 4] == ["--nnodes", "2", "--node-rank", str(rank)], argv
        assert argv[argv.index("--dist-init-addr") + 1].startswith(leader + "."), argv
    greedy_through_router(deployment, offline_engine, count=2, recover_s=60)


def test_metrics_of_every_worker_pod_and_the_router_count_what_was_sent(deployment, offline_engine):
    pods = _worker_pods(deployment, "prefill") + _worker_pods(deployment, "decode")
    assert len(pods) == 3
    router_url = _router_metrics_url(deployment)
    before = {p["metadata"]["name"]: scrape(metrics_url(p)) for p in pods}
    router_before = scrape(router_url)
    sent = greedy_through_router(deployment, offline_engine, count=random.randint(3, 5), max_new=MAX_NEW)
    after = {p["metadata"]["name"]: scrape(metrics_url(p)) for p in pods}
    router_after = scrape(router_url)
    n, prompt_tokens = len(sent), sum(len(p) for p, _ in sent)
    generated = sum(len(out) for _, out in sent)

    def delta(pod: str, metric: str, **labels: str) -> float:
        return total(after[pod], f"deepseek_pd:{metric}", **labels) - \
            total(before[pod], f"deepseek_pd:{metric}", **labels)
    prefill, leader, follower = (p["metadata"]["name"] for p in pods)
    # Every pod exports its own rank's series, labelled with its role and rank.
    for pod, role, rank in ((prefill, "prefill", "0"), (leader, "decode", "0"), (follower, "decode", "1")):
        assert total(after[pod], "deepseek_pd:kv_pool_total_pages", role=role, rank=rank) > 0, (pod, after[pod])
    # The request series come from each group's rank 0: prefill gives each request its first token,
    # decode the whole stream.
    assert (delta(prefill, "num_requests_total"), delta(prefill, "prompt_tokens_total"),
            delta(prefill, "generation_tokens_total")) == (n, prompt_tokens, n)
    assert (delta(leader, "num_requests_total"), delta(leader, "prompt_tokens_total"),
            delta(leader, "generation_tokens_total")) == (n, prompt_tokens, generated)
    assert delta(follower, "num_requests_total") == 0
    # Decode steps run on the DP rank that owns the request: over both ranks, one row per token
    # after the first (which came from prefill), plus at most one for each request that stopped on
    # EOS before its length limit (the overlap schedule had already launched its next step, whose
    # token is dropped; a length limit is known ahead and never launched past).
    rows = delta(leader, "step_tokens_total", mode="decode") + delta(follower, "step_tokens_total", mode="decode")
    stopped_early = sum(len(out) < MAX_NEW for _, out in sent[1:])  # sent[0] asked for one token
    assert generated - n <= rows <= generated - n + stopped_early, (rows, generated, n, stopped_early)
    # The router's own exporter (smg): the HTTP requests it took and the decode worker it sent them to.
    assert any(name.startswith("smg_") for name, _ in router_after)
    routed = total(router_after, "smg_http_request_duration_seconds_count", path="/generate") - \
        total(router_before, "smg_http_request_duration_seconds_count", path="/generate")
    assert routed == n, (routed, n)
    worker = f"grpc://{leader}."
    to_decode = sum(v - router_before.get(key, 0.0) for key, v in router_after.items()
                    if key[0] == "smg_worker_requests_total" and dict(key[1]).get("worker", "").startswith(worker))
    assert to_decode == n, (to_decode, n, [k for k in router_after if k[0] == "smg_worker_requests_total"])


def test_killed_follower_restarts_the_whole_group_and_requests_recover(deployment, offline_engine):
    decode = _worker_pods(deployment, "decode")
    follower = next(p for p in decode if p["metadata"]["labels"][POD_INDEX] == "1")
    pid = int(follower["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
    old_uids = {p["metadata"]["uid"] for p in decode}
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # the follower's worker process: an OOM kill, as the kubelet sees it

    def both_replaced():
        pods = _worker_pods(deployment, "decode")
        return pods if len(pods) == 2 and not old_uids & {p["metadata"]["uid"] for p in pods} else None
    wait_until(both_replaced, 180, "the decode group was not recreated as a whole", deployment.diagnose)
    deployment.wait_phase("Available", timeout_s=300, where=lambda cr: cr["status"]["decode"]["readyReplicas"] == 1)
    greedy_through_router(deployment, offline_engine, count=3, recover_s=90)
    print(f"follower killed -> group recreated and serving in {time.monotonic() - started:.1f} s")
