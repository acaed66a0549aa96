"""The operator and the workers agree: the pods it renders run, behind the router it renders.

For examples/cpu-minimal.yaml as shipped (one pod per group) and with 2 pods per group (one role
`dp 2, ep 2`, the other `tp 2`; which role gets which is drawn per run), the operator's pure
builders render every child (pdtest.rendered_pods: StatefulSets, Services, ConfigMaps, Secrets,
the router Deployment). Each container (the model init container, the worker, the router) gets
its env and `$(VAR)` expansion exactly as the kubelet gives them (pdtest.pod_inputs: LWS_LEADER_ADDRESS,
LWS_GROUP_SIZE, LWS_WORKER_INDEX from the pod-index label, metadata.name, status.podIP). Then only
the substitutions listed in pdtest.local_pods stand in for a node: cluster names -> 127.0.0.1,
container ports -> free local ports, paths under volume mounts -> local directories (the model's
hostPath holds the tiny checkpoint), `deepseek-pd`/`python3` -> this interpreter. Every pod's
processes start (gloo on CPU, the LWS variables filled in); a flag `serve` or smg refuses exits
at start and fails the test with its log. The test waits (bounded) until the rendered router
(smg, Static discovery: grpc:// leader URLs) reports every group's leader healthy, sends one greedy
request through it, compares the tokens with the offline engine, then stops every pod and fails
if any process of one is left.

Not run here: examples/deepseek-v3-h200.yaml (8 GPUs per pod, FP8 weights, Mooncake over RDMA
HCAs). Each of its pods' argv is parsed and resolved by `serve`'s own resolution in
test_operator_group_layout.py (as if on an 8-GPU node with those HCAs), not started. Probes,
securityContext, resources and the /dev/shm tmpfs are not exercised (tests/k8s runs pods in
sandboxes on a real control plane).
"""
from __future__ import annotations

import asyncio
import pathlib
import random
import time

import pytest

from deepseek_pd.client.router_http import RouterClient
from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec

from pdtest.gateway_oracle import offline_greedy
from pdtest.local_deployment import LocalDeployment
from pdtest.local_pods import LOCALHOST, Command, LocalPod, localize, tiny_model_host_paths
from pdtest.rendered_pods import RenderedDeployment, cpu_minimal_spec

pytestmark = pytest.mark.timeout(420)

READY_TIMEOUT_S = 300  # 5 processes importing torch on a shared CI core or two


def _router_url(pods: list[LocalPod], spec: DeploymentSpec) -> str:
    router = next(p for p in pods if p.pod["metadata"]["labels"].get(names.LABEL_COMPONENT) == "router")
    return f"http://{LOCALHOST}:{router.ports[spec.router.port]}"


@pytest.mark.slow
@pytest.mark.parametrize("pods_per_group", [1, 2], ids=["as-shipped", "2-pods-per-group"])
def test_rendered_pods_serve_behind_the_rendered_router(tmp_path, pods_per_group) -> None:
    from deepseek_pd.workers.engine.offline import Engine

    rng = random.Random()
    spec = cpu_minimal_spec(rng, pods_per_group)
    pods = localize(RenderedDeployment(spec, pod_ip=LOCALHOST), tmp_path / "pods", tiny_model_host_paths(spec, tmp_path))
    workers = sum(p.pod["metadata"]["labels"].get(names.LABEL_POD_INDEX) == "0" for p in pods)
    assert workers == spec.prefill.replicas + spec.decode.replicas  # one leader per group
    prompt = [rng.randrange(3, 250) for _ in range(rng.randint(2, 24))]
    budget = rng.randint(3, 8)
    want, _ = offline_greedy(Engine(model="tiny"), prompt, budget)
    router_url = _router_url(pods, spec)
    with LocalDeployment(pods, tmp_path / "logs") as deployment:
        deployment.wait_router_ready(router_url, workers, READY_TIMEOUT_S)

        async def one() -> list[int]:
            async with RouterClient(router_url, spec.model.served_name, timeout_s=120) as client:
                result = await client.generate(input_ids=prompt, max_new_tokens=budget, temperature=0.0,
                                               ignore_eos=True)
            return result.output_ids
        got = asyncio.run(one())
        deployment.check_running()
        assert got == want, "\n".join(deployment.log_tail(name, 15) for name in deployment.running)


def _pod_running(tmp_path: pathlib.Path, script: str) -> LocalPod:
    command = Command("p-0/worker", ["sh", "-c", script], {}, tmp_path / "p-0")
    return LocalPod({"metadata": {"name": "p-0"}}, {}, main=[command])


def test_the_harness_fails_on_an_exited_container_and_on_an_orphan(tmp_path) -> None:
    """What the test above relies on: a container that exits (as `serve` does, rc 2, on a flag it
    refuses) fails the wait at once with its log; a process that escaped its pod's process group
    and outlives the teardown fails the test (and is killed)."""
    word = f"refused-{random.randrange(10**6)}"
    with pytest.raises(AssertionError, match=f"(?s)exited with 2.*{word}"):
        with LocalDeployment([_pod_running(tmp_path, f"echo {word}; exit 2")], tmp_path / "a") as deployment:
            deployment.wait_router_ready("http://127.0.0.1:9", 1, timeout_s=30)
    with pytest.raises(AssertionError, match="outlived their pods"):
        # The orphan lives 60 s: a 1 s wait for it to end finds it as surely as the default 10 s.
        with LocalDeployment([_pod_running(tmp_path, "setsid sleep 60 & sleep 60")], tmp_path / "b",
                             orphan_wait_s=1) as deployment:
            time.sleep(0.5)  # let the escaping child start
            deployment.check_running()
