"""SLO autoscaling of both roles against the real control plane, the real kube-scheduler (it binds
the worker pods), the process kubelet and real workers: the chart's operator scrapes the worker
pods' /metrics; load through the router's Service (sent by `bench serving`'s own loop,
deepseek_pd/loadgen/runner.py) raises decode (TPOT p90) and prefill (TTFT p90) to 2 groups, and
idleness brings both back to 1. Decode group 1 is retired while long streams run on it: they
finish, whole and with the offline engine's tokens. Every request during all of it answers with
the offline engine's greedy tokens, and the status and Events say why each change happened.

The targets are calibrated first from what the operator itself reads under the scaling load
(CPU speed here varies with whatever else runs), then set to half of that."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import threading
import time

import pytest
from e2e_deployment import CR_API, installed_release
from e2e_example import apply, example
from pdtest.waiting import wait_until
from pod_metrics import metrics_url, scrape, total

from deepseek_pd.operator import names

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
RELEASE, OPS, NS = "autoscale", "ops-as", "llm-as"
MAX_NEW = 24
ROLES = ("prefill", "decode")
METRIC = {"prefill": "ttftP90Seconds", "decode": "tpotP90Seconds"}  # what each role scales on here


@pytest.fixture(scope="module")
def deployment(control_plane, admin_kube, process_kubelet, tmp_path_factory):
    with installed_release(control_plane, admin_kube, process_kubelet, tmp_path_factory.mktemp("autoscale-e2e"),
                           RELEASE, OPS, NS, "--set", "operator.resyncSeconds=2") as dep:
        yield dep


def _status(dep, role: str) -> dict:
    return ((dep.cr() or {}).get("status") or {}).get("autoscaling", {}).get(role, {})


def _replicas(dep, role: str) -> int:
    return dep.cr()["spec"][role]["replicas"]


def _scheduled_by(pod: dict, scheduler: str) -> bool:
    return pod["spec"].get("schedulerName") == scheduler and bool(pod["spec"].get("nodeName"))


class Load:
    """Greedy requests through the router, sent by `bench serving`'s own code
    (deepseek_pd/loadgen/runner.py: `run_load` in closed loop, `concurrency` in flight, each request
    streamed by `router_target`, ignore_eos as the bench sends it), in rounds of 2 x `concurrency`
    requests until `until()`; every answer is checked against the offline engine (prompts drawn
    from a fixed pool, answers precomputed), and a wrong one is that request's error.

    There is no kube-proxy here: the router Service's address is its first ready pod
    (`Deployment.router_url`). Adding or removing a group rolls the router (Static discovery), and
    a connection refused by a router pod that has gone is what a Service would have sent to the
    new pod: the request looks the endpoint up again and is sent there. Any other error, and any
    wrong token, is a failure."""

    def __init__(self, dep, engine, rng: random.Random) -> None:
        from deepseek_pd.model.sampling.params import SamplingParams
        self.dep = dep
        self.prompts = [tuple(rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(4, 40))) for _ in range(8)]
        self.expected = {p: list(engine.generate(list(p), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                                         ignore_eos=True)).output_ids)
                         for p in self.prompts}
        self.sent = 0
        self.done = 0
        self.rerouted = 0
        self.dropped_by_roll = 0  # requests cut by a router pod that was rolled away, then re-sent
        self.drop_reasons: set[str] = set()
        self.failures: list[str] = []
        self._url = ""
        self._clients: dict[str, object] = {}  # router URL -> RouterClient (requests in flight keep theirs)

    async def _client(self):
        from deepseek_pd.client.router_http import RouterClient

        if self._url not in self._clients:
            self._clients[self._url] = await RouterClient(self._url, "tiny", timeout_s=300).__aenter__()
        return self._clients[self._url]

    async def _moved(self, client, wait_s: float) -> bool:
        """Looks the Service's endpoint up again, for up to `wait_s` (the endpoint moves once the
        old router pod is no longer ready); whether it moved away from `client`'s."""
        deadline = time.monotonic() + wait_s
        while True:
            url = (await asyncio.to_thread(self.dep.router_url)).rstrip("/")
            if url != client.base_url:
                self._url = url
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.25)

    async def _send(self, request):
        """The bench's `router_target`, through the router pod the Service names now."""
        import aiohttp

        from deepseek_pd.loadgen.runner import router_target

        for attempt in range(3):
            client = await self._client()
            try:
                result = await router_target(client)(request)
            except aiohttp.ClientConnectorError:  # never reached a router pod
                await self._moved(client, 0.0)
                self.rerouted += 1
                if attempt == 2:
                    raise
                continue
            except aiohttp.ClientConnectionError as exc:  # cut mid-request: disconnected, reset
                # The router pod this request went to was rolled away under it (adding or removing
                # a group rolls the router): counted apart and re-sent, but only when the endpoint
                # really moved; a cut from a router still in place is a failure. Loaded runs saw
                # ServerDisconnectedError and "Can not write request body" (ClientOSError): a
                # request sent on a kept-alive connection that the draining router pod closed; no
                # answer had started. A stream cut once it has started (ClientPayloadError) is
                # always a failure.
                if not await self._moved(client, 10.0) or attempt == 2:
                    raise
                self.dropped_by_roll += 1
                self.drop_reasons.add(type(exc).__name__)
                continue
            want = self.expected[request.input_ids]
            if result.output_ids != want:
                raise AssertionError(f"prompt {list(request.input_ids)}: {result.output_ids} != {want}")
            return result

    async def run(self, concurrency: int, until) -> None:
        from deepseek_pd.loadgen.runner import run_load
        from deepseek_pd.loadgen.workload import BenchRequest

        self._url = (await asyncio.to_thread(self.dep.router_url)).rstrip("/")
        try:
            while not self.failures and not await asyncio.to_thread(until):  # the first failure ends it
                batch = [BenchRequest(self.prompts[(self.sent + k) % len(self.prompts)], MAX_NEW)
                         for k in range(2 * concurrency)]
                self.sent += len(batch)
                records, _ = await run_load(self._send, batch, float("inf"), concurrency, show_progress=False)
                self.done += sum(r.success for r in records)
                self.failures += [r.error for r in records if not r.success]
        finally:
            for client in self._clients.values():
                await client.close()
            self._clients.clear()


class RunningStreams:
    """Long greedy streams through the router, each in a thread of its own, started before a
    scale-down and left running through it. A retired group must finish what it streams: the
    router rolls without it first, the old router pod (terminating, its grace 180 s) holds those
    streams to their end, and the group's pods go only once no router pod names it (the workers'
    own drain here is 2 s: e2e_cluster.WORKER_ARGS, far shorter than the streams). A stream cut,
    ended short, or with other first tokens than the offline engine's (the Load's answers: greedy
    with ignore_eos, so a longer answer starts with the shorter one) is a failure."""

    def __init__(self, dep, expected: dict[tuple, list[int]], length: int) -> None:
        self.dep, self.expected, self.length = dep, expected, length
        self.results: list[tuple[tuple, object]] = []  # (prompt, GenerateResult | the exception)
        self.threads: list[threading.Thread] = []

    def start(self, prompt: tuple) -> None:
        url = self.dep.router_url().rstrip("/")
        thread = threading.Thread(target=self._stream, args=(url, prompt), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _stream(self, url: str, prompt: tuple) -> None:
        from deepseek_pd.client.router_http import RouterClient

        async def one():
            async with RouterClient(url, "tiny", timeout_s=600) as client:
                return await client.generate(input_ids=list(prompt), stream=True, max_new_tokens=self.length,
                                             temperature=0.0, ignore_eos=True)
        try:
            self.results.append((prompt, asyncio.run(one())))
        except Exception as exc:  # noqa: BLE001 - a cut stream is the failure this records
            self.results.append((prompt, exc))

    def running(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def failures(self, timeout_s: float) -> list[str]:
        """Waits for every stream (up to `timeout_s` in all); what went wrong with any of them."""
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        failed = [f"{len(self.threads) - len(self.results)} streams still running after {timeout_s:.0f} s"] \
            if len(self.results) < len(self.threads) else []
        for prompt, result in self.results:
            want = self.expected[prompt]
            if isinstance(result, Exception):
                failed.append(f"prompt {list(prompt)}: {type(result).__name__}: {result}")
            elif len(result.output_ids) != self.length or result.output_ids[:len(want)] != want:
                failed.append(f"prompt {list(prompt)}: {len(result.output_ids)} tokens "
                              f"({result.finish_reason}), first {result.output_ids[:len(want)]} != {want}")
        return failed


def _running_on(dep, group: int) -> int:
    """Requests in the running batch of decode group `group` (its pods' own metrics)."""
    pods = dep.pods(f"{_role_pods(dep, 'decode')},deepseek-pd.io/group-index={group}")
    return int(sum(total(scrape(metrics_url(p)), "deepseek_pd:num_running_reqs") for p in pods
                   if not p["metadata"].get("deletionTimestamp") and (p.get("status") or {}).get("podIP")))


def _role_pods(dep, role: str) -> str:
    return f"deepseek-pd.io/deployment={dep.name},deepseek-pd.io/role={role}"


def _scaled(dep) -> list[str]:
    events = dep.kube.list(f"/api/v1/namespaces/{NS}/events", fieldSelector=f"involvedObject.name={dep.name}")
    return [e["message"] for e in events if e.get("reason") == "Scaled"]


def test_load_adds_groups_of_both_roles_and_idleness_removes_them_finishing_running_streams(
        deployment, models, offline_engine, real_scheduler, monkeypatch):
    dep, rng = deployment, random.Random()
    # The process kubelet cuts every pod's grace period to 10 s (fast teardowns); here the old
    # router pod's full grace (190 s) is what lets it finish the retired group's streams, as a
    # real kubelet would.
    monkeypatch.setattr(dep.kubelet, "config", dataclasses.replace(dep.kubelet.config, termination_grace_cap_s=200.0))
    obj = example(models)
    obj["spec"]["scheduling"] = {"schedulerName": real_scheduler}  # bound by the real kube-scheduler
    # Round robin, so that the long streams below reach both decode groups (cache_aware sent the
    # pool's prompts, all cached, to the group that served them first).
    obj["spec"].setdefault("router", {})["policy"] = "round_robin"
    # Under load the roles may only grow: a long scale-down window holds the groups added (with
    # both roles growing on two cores the readings swing; a 10 s window let a role shrink under
    # the load and grow again, once for 100 s). Idleness below sets it to 0.
    windows = {"scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 600}
    for role in ROLES:
        obj["spec"][role]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2, **windows,
                                            "metrics": [{"name": METRIC[role], "target": 1000.0}]}
    began = time.monotonic()
    apply(dep, obj)
    dep.wait_phase("Available")
    workers = dep.pods(f"deepseek-pd.io/deployment={dep.name},deepseek-pd.io/role")
    assert workers and all(_scheduled_by(p, real_scheduler) for p in workers), [p["spec"] for p in workers]
    load = Load(dep, offline_engine, rng)
    print(f"Available and the load's answers computed after {time.monotonic() - began:.0f} s")

    # Calibrate under the load that must scale up (16 streams on one group of each role, the
    # targets still out of reach): the p90s the operator reads over ~6 passes (each pass reads the
    # requests finished since the one before; 10 passes, 25 s, gave the same medians within a few
    # percent, seed 1: prefill 0.17-0.32 s, median 0.18; decode 0.014-0.019 s). Each target is
    # 0.35 of its median, so the same load reads ~3x the target (HPA's rule: 2 groups at most)
    # and, likely, over it once the other role has grown (TTFT includes decode's side). At half
    # the median one suite run took 160 s instead of ~80 s, the slow phase unrecorded.
    # A batch-1 calibration was not enough: on a quiet machine the tiny model's step barely grows
    # with the batch, and 16 streams read below 1.5x batch 1's.
    seen: dict[str, list[float]] = {role: [] for role in ROLES}
    deadline = time.monotonic() + 12

    def calibrated() -> bool:
        for role in ROLES:
            reading = _status(dep, role).get("lastDecision", {}).get("readings", {}).get(METRIC[role], 0.0)
            if reading:
                seen[role].append(reading)
        return time.monotonic() > deadline and all(len(s) >= 3 for s in seen.values())
    asyncio.run(asyncio.wait_for(load.run(16, calibrated), 180))
    assert not load.failures and all(seen.values()), (load.failures[:5], seen)
    target = {role: 0.35 * statistics.median(seen[role]) for role in ROLES}
    print(f"calibrated after {time.monotonic() - began:.0f} s over {seen}")
    dep.kube.merge_patch(f"{CR_API}/namespaces/{NS}/deepseekdeployments/{dep.name}",
                         {"spec": {role: {"autoscaling": {**obj["spec"][role]["autoscaling"], "metrics": [
                             {"name": METRIC[role], "target": target[role]}]}} for role in ROLES}})

    # Load: 16 streams until the second group of each role serves (its pods Ready, the router
    # rolled; one role changes per pass).
    def both_grew() -> bool:
        cr = dep.cr()
        return cr["status"].get("phase") == "Available" and all(
            cr["spec"][role]["replicas"] == 2 and cr["status"][role]["readyReplicas"] == 2 for role in ROLES)
    started = time.monotonic()
    asyncio.run(asyncio.wait_for(load.run(16, both_grew), 600))
    print(f"targets {target}; scaled up after {time.monotonic() - started:.0f} s, {load.done} requests "
          f"({load.rerouted} re-sent to a new router pod, {load.dropped_by_roll} cut by a router roll and re-sent: "
          f"{sorted(load.drop_reasons)}); decisions {json.dumps({r: _status(dep, r).get('lastScale') for r in ROLES})}")
    assert not load.failures, load.failures[:5]
    scaled = _scaled(dep)
    for role in ROLES:
        assert any(m.startswith(f"{role}: scale up 1 -> 2: {METRIC[role]}") for m in scaled), (role, scaled)

    # From here on the roles may only shrink: a long scale-up window keeps the idle readings'
    # recommendation (1 group) in mind, so the long streams' own readings cannot bring a retired
    # group back while it drains.
    path = f"{CR_API}/namespaces/{NS}/deepseekdeployments/{dep.name}"
    dep.kube.merge_patch(path, {"spec": {role: {"autoscaling": {"scaleUpStabilizationSeconds": 3600}} for role in ROLES}})

    # Long streams, one at a time until decode group 1 runs one (round robin: at most two). They
    # finish no request, so the operator reads the roles as idle while group 1 streams. As long
    # as the model's context allows (4096), two of them fit one decode pool (2048 pages of 4).
    length = 4096 - max(map(len, load.prompts)) - 8
    streams = RunningStreams(dep, load.expected, length)
    for prompt in load.prompts[:2]:
        before = _running_on(dep, 0) + _running_on(dep, 1)
        streams.start(prompt)
        wait_until(lambda: _running_on(dep, 0) + _running_on(dep, 1) > before, 60, "a stream never ran on decode",
                   dep.diagnose)
        if _running_on(dep, 1):
            break
    assert _running_on(dep, 1), "no stream went to decode group 1"
    print(f"{len(streams.threads)} streams of {length} tokens running after {time.monotonic() - began:.0f} s")

    # Idle from now on: with no scale-down window the next passes choose 1 group for each role.
    # The spec patch and the status that explains it are two writes: wait for both.
    dep.kube.merge_patch(path, {"spec": {role: {"autoscaling": {"scaleDownStabilizationSeconds": 0}} for role in ROLES}})

    def shrunk(role: str) -> bool:
        return _replicas(dep, role) == 1 and (_status(dep, role).get("lastScale") or {}).get("to") == 1
    wait_until(lambda: shrunk("decode"), 180, "decode not scaled down", dep.diagnose)
    print(f"decode scaled down after {time.monotonic() - began:.0f} s; group 1 runs {_running_on(dep, 1)} streams")
    # What this shows needs the old router pod to be going while group 1 still streams: the
    # router has rolled without group 1, and only the terminating pod holds its streams.
    routers = f"deepseek-pd.io/deployment={dep.name},app.kubernetes.io/component=router"

    def names_group_1(pod: dict) -> bool:
        return names.leader_address(dep.name, "decode", 1, NS) in " ".join(pod["spec"]["containers"][0]["args"])

    def only_a_terminating_router_names_group_1() -> bool:
        pods = dep.pods(routers)
        going = [p for p in pods if p["metadata"].get("deletionTimestamp")]
        return any(map(names_group_1, going)) and not any(names_group_1(p) for p in pods if p not in going)
    wait_until(only_a_terminating_router_names_group_1, 120, "the router never rolled without decode group 1",
               dep.diagnose)
    on_group_1 = _running_on(dep, 1)
    print(f"old router pod terminating after {time.monotonic() - began:.0f} s; group 1 runs {on_group_1} streams")
    assert on_group_1, "the streams ended before the router rolled: they show nothing (make them longer)"
    down = _status(dep, "decode")["lastScale"]
    assert down["from"] == 2 and down["reason"].startswith("scale down 2 -> 1"), down
    assert not (failed := streams.failures(300)), failed
    wait_until(lambda: shrunk("prefill"), 120, "prefill not back to 1 group", dep.diagnose)
    print(f"streams done and prefill at 1 group after {time.monotonic() - began:.0f} s")

    # While decode group 1 is retired (the router rolls without it first, then its pods go), 4
    # streams keep asking, at least one round of them: none may fail. Its pods are known by UID.
    before = load.done
    group_1 = f"{_role_pods(dep, 'decode')},deepseek-pd.io/group-index=1"
    retired = {p["metadata"]["uid"] for p in dep.pods(group_1)}
    asyncio.run(asyncio.wait_for(load.run(4, lambda: load.done > before and not retired & {
        p["metadata"]["uid"] for p in dep.pods(group_1)}), 600))
    assert load.done > before and not load.failures, load.failures[:5]
    scaled = _scaled(dep)
    for role in ROLES:
        assert any(m.startswith(f"{role}: scale down 2 -> 1") for m in scaled), (role, scaled)
