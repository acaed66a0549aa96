"""Every pod the operator renders for a multi-rank group, resolved by `serve` itself.

For each example (the V3 multi-node one, and cpu-minimal with 2-pod groups) and each role, the
pods of a group are rendered, their `$(VAR)` arguments expanded from the pod's own env as the
kubelet does (pdtest.pod_inputs: LWS_WORKER_INDEX from the pod-index label, LWS_LEADER_ADDRESS), parsed by the real
CLI parser and resolved by `resolve_serve_config`. The resulting `GroupLayout` must be the one the
CR meant: tp x dp ranks over `size` nodes, `gpusPerPod` local ranks each, this pod's node rank,
rank 0's rendezvous address, the CR's DeepEP mode and expert parallelism; the address peers reach
the pod at is its IP, and a prefill pod's bootstrap answers to its DNS name (the leader's is the
one the router lists).

The V3 pods ask for `--device cuda` and Mooncake over the listed RDMA devices; this machine has
neither, so the test pretends to be such a node (8 GPUs, those HCAs) and uses V3's real
config.json (transformers' DeepseekV3Config defaults). Nothing else is faked.
"""
from __future__ import annotations

import json
import pathlib
import random
import re

import pytest
import yaml

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.operator import names
from deepseek_pd.operator.build_workers import DIST_INIT_PORT, POD_IP_ENV, build_group_statefulset
from deepseek_pd.units import GIB
from deepseek_pd.operator.memory_plan import plan_memory
from deepseek_pd.operator.spec import DeploymentSpec

from pdtest.pod_inputs import container_env, expand
from pdtest.rendered_pods import RenderedDeployment

pytestmark = pytest.mark.timeout(120)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
_VAR = re.compile(r"\$\(([A-Z_][A-Z0-9_]*)\)")


def _spec(example: str, rng: random.Random) -> DeploymentSpec:
    raw = yaml.safe_load((EXAMPLES / example).read_text())["spec"]
    if example == "cpu-minimal.yaml":  # 2-pod groups of one CPU rank each, as a user scales it up
        for role in ("prefill", "decode"):
            raw[role]["size"] = 2
            raw[role]["parallelism"] = rng.choice([{"dp": 2, "ep": 2}, {"tp": 2, "dp": 1, "ep": 1},
                                                   {"dp": 2, "ep": 1}])
    return DeploymentSpec.parse("demo", "llm", raw)


@pytest.fixture
def v3_node(tmp_path, monkeypatch) -> pathlib.Path:
    """A GPU node with the V3 example's HCAs, and a directory with V3's config.json."""
    import torch
    from transformers import DeepseekV3Config

    from deepseek_pd.workers.serve import resolution as serve_resolution

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(serve_resolution, "usable_rdma_devices", lambda: tuple(f"mlx5_{i}" for i in range(8)))
    model = tmp_path / "DeepSeek-V3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(DeepseekV3Config().to_dict()))
    return model


@pytest.mark.parametrize("example", ["deepseek-v3-h200.yaml", "cpu-minimal.yaml"])
def test_every_rendered_pod_resolves_to_the_layout_the_cr_meant(example, v3_node, monkeypatch) -> None:
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    rng = random.Random()
    spec = _spec(example, rng)
    parser = build_parser()
    rendered = RenderedDeployment(spec, pod_ip="10.0.3.7")
    for role_name in names.ROLES:
        role = spec.role(role_name)
        index = rng.randrange(role.replicas)
        statefulset = build_group_statefulset(spec, role_name, index)
        assert statefulset["spec"]["replicas"] == role.size
        leader = names.leader_address(spec.name, role_name, index, spec.namespace)
        group = names.group_selector(spec.name, role_name, index)
        pods = [pod for pod in rendered.pods() if group.items() <= pod["metadata"]["labels"].items()]
        assert [pod["metadata"]["labels"][names.LABEL_POD_INDEX] for pod in pods] == [str(i) for i in range(role.size)]
        for pod_index, pod in enumerate(pods):
            container = pod["spec"]["containers"][0]
            env = container_env(rendered, pod, container, {})
            argv = [expand(arg, env) for arg in container["args"]]
            assert not any(_VAR.search(arg) for arg in argv), argv  # the kubelet expands every one
            flags = flags_from_args(parser.parse_args(argv))
            # The image's weights are not here: V3's config, or the generated tiny checkpoint.
            flags = _with_model(flags, v3_node if example == "deepseek-v3-h200.yaml" else "tiny")
            resolved = resolve_serve_config(flags)
            layout = resolved.group
            # Peers (a group's ranks, Mooncake, decode's identity) reach this pod at its IP.
            assert resolved.worker.transport.advertise_host == env[POD_IP_ENV], argv
            if role_name == "prefill":  # and decode dials the name the router lists: its DNS name
                pod_dns = f"{statefulset['metadata']['name']}-{pod_index}.{statefulset['spec']['serviceName']}.llm.svc"
                assert resolved.worker.bootstrap.aliases == (pod_dns,)
                assert pod_index > 0 or pod_dns == leader
            par = role.parallelism
            assert (layout.tp, layout.dp, layout.ep) == (par.tp, par.dp, par.ep), argv
            assert layout.world == role.world_size and layout.local_ranks == max(role.gpus_per_pod, 1)
            assert layout.nnodes == role.size and layout.node_rank == pod_index
            if role.size > 1:
                assert layout.dist_init_addr == f"{leader}:{DIST_INIT_PORT}"
            assert layout.deepep_mode == (role.deepep_mode if par.ep > 1 else "none")
            assert list(layout.node_ranks) == list(range(pod_index * layout.local_ranks,
                                                         (pod_index + 1) * layout.local_ranks))


def test_a_pod_whose_ranks_outnumber_its_gpus_is_refused_at_resolution(v3_node, monkeypatch) -> None:
    """`--dp 16 --nnodes 2` needs 8 GPUs per pod: on a node with fewer, serve says so at once."""
    import torch

    from deepseek_pd.errors import UserError
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    gpus = random.randint(1, 7)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    argv = ["serve", "decode", "--model", str(v3_node), "--device", "cuda", "--dp", "16", "--ep", "16",
            "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "leader.svc:5757"]
    with pytest.raises(UserError, match=f"8 ranks.*{gpus} GPU"):
        resolve_serve_config(flags_from_args(build_parser().parse_args(argv)))


def _with_model(flags, model_dir: pathlib.Path | str):
    import dataclasses

    return dataclasses.replace(flags, model=str(model_dir))



def _resolved_runner(spec: DeploymentSpec, role_name: str, model_dir: pathlib.Path):
    """The RunnerConfig `serve` resolves from the first rendered pod of `role_name`'s group 0."""
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    rendered = RenderedDeployment(spec, pod_ip="10.0.3.7")
    group = names.group_selector(spec.name, role_name, 0)
    pod = next(pod for pod in rendered.pods() if group.items() <= pod["metadata"]["labels"].items())
    container = pod["spec"]["containers"][0]
    argv = [expand(arg, container_env(rendered, pod, container, {})) for arg in container["args"]]
    return resolve_serve_config(_with_model(flags_from_args(build_parser().parse_args(argv)), model_dir)).runner


@pytest.mark.parametrize("role_name", names.ROLES)
def test_the_memory_plan_reserves_the_headroom_the_worker_resolves(role_name, v3_node) -> None:
    """The plan's graph headroom (operator/memory_plan.py headroom_gib) equals `RunnerConfig.headroom_gib` of
    the rendered pod as `serve` resolves it, for random flags that size or stop the graphs. Experts
    are replicated (ep 1, the `local` dispatcher) so that nothing the image decides blocks graphs:
    with ep > 1 this node has no deep_ep, whose low-latency mode the plan assumes capturable."""
    rng = random.Random()
    raw = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())["spec"]
    raw["model"].pop("numRoutedExperts")  # ep 1 divides it anyway; keep the spec minimal
    role = raw[role_name]
    role.update(size=1, parallelism={"tp": rng.choice([1, 1, 2]), "ep": 1}, engineArgs=rng.sample(
        [f"--engine-opt=max_running_requests={rng.choice([64, 128, 256, 512])}",
         f"--engine-opt=cuda_graph_max_batch={rng.choice([32, 160, 384])}",
         f"--engine-opt=cuda_graph={rng.choice(['true', 'false'])}",
         "--enable-tbo", "--engine-opt=record_expert_load=true", "--engine-opt=mem_headroom_gib=3.5"],
        rng.randint(0, 3)))
    if role["parallelism"]["tp"] > 1 and "--enable-tbo" in role["engineArgs"]:
        role["engineArgs"].remove("--enable-tbo")  # serve refuses TBO with attention TP
    uncapturable = {"--enable-tbo", "--engine-opt=record_expert_load=true"} & set(role["engineArgs"])
    if "--engine-opt=cuda_graph=true" in role["engineArgs"] and (role_name == "prefill" or role["parallelism"]["tp"] > 1
                                                            or uncapturable):
        role["engineArgs"].remove("--engine-opt=cuda_graph=true")  # serve refuses graphs it cannot capture
    spec = DeploymentSpec.parse("demo", "llm", raw)
    runner = _resolved_runner(spec, role_name, v3_node)
    planned = next(r for r in plan_memory(spec).ranks if r.role == role_name)
    assert planned.reserve_bytes == int(runner.headroom_gib * GIB), (role["engineArgs"], role["parallelism"], runner)
    if role_name == "decode" and "--engine-opt=cuda_graph=true" in role["engineArgs"]:
        assert runner.cuda_graph  # the case whose headroom grows with the graph batch is exercised
    if role_name == "decode" and role["parallelism"]["tp"] == 1 and not role["engineArgs"]:
        # the example speculates: its draft and verify graphs are on by default, in the plan as in the worker
        assert runner.cuda_graph and runner.speculative_num_steps > 0


@pytest.mark.parametrize("role_name", names.ROLES)
def test_the_memory_plan_reserves_the_staging_the_worker_resolves(role_name, v3_node) -> None:
    """The plan's Mooncake staging bytes (operator/memory_plan.py) equal `RunnerConfig.mem_reserve_bytes`
    of the rendered pod as `serve` resolves it (workers/serve/kv_staging.py, the one rule), for a
    random KV transport, protocol, staging size, page size and speculation: every rank over
    Mooncake keeps it out of its pool (prefill's send staging holds the ciphertext, over TCP too:
    transport/kv_cipher.py), a rank over gRPC none."""
    rng = random.Random()
    raw = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())["spec"]
    raw["model"].pop("numRoutedExperts")
    backend, protocol = rng.choice([("mooncake", "rdma"), ("mooncake", "tcp"), ("grpc", "tcp")])
    raw["kvTransfer"].update(backend=backend, protocol=protocol,
                             devices=raw["kvTransfer"]["devices"] if protocol == "rdma" else [])
    if rng.random() < 0.5:
        raw["decode"].pop("speculative", None)  # no MTP layer: one KV layer fewer
    role = raw[role_name]
    role.update(size=1, parallelism={"tp": 1, "ep": 1}, engineArgs=rng.sample(
        [f"--engine-opt=mooncake_staging_tokens={rng.randint(1, 1 << 16)}", f"--page-size={rng.choice([16, 32, 64])}",
         "--dtype=float16"], rng.randint(0, 3)))
    spec = DeploymentSpec.parse("demo", "llm", raw)
    runner = _resolved_runner(spec, role_name, v3_node)
    planned = next(r for r in plan_memory(spec).ranks if r.role == role_name)
    assert planned.staging_bytes == runner.mem_reserve_bytes, (backend, protocol, role["engineArgs"])
    stages = backend == "mooncake"
    assert (runner.mem_reserve_bytes > 0) == stages


@pytest.mark.parametrize("protocol", ["rdma", "tcp"])
def test_each_local_rank_of_a_rendered_v3_pod_gets_its_own_rdma_device(v3_node, protocol) -> None:
    """The V3 example's pods run 8 ranks each over 8 HCAs: every rank's TransferEngine starts on
    the HCA at its local rank's position in kvTransfer.devices (drawn in a random order here),
    the one beside its GPU, not on all eight; over tcp every rank gets none."""
    from deepseek_pd.workers.serve.group_main import rank_config
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    rng = random.Random()
    raw = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())["spec"]
    devices = rng.sample(raw["kvTransfer"]["devices"], len(raw["kvTransfer"]["devices"]))
    raw["kvTransfer"].update(protocol=protocol, devices=devices if protocol == "rdma" else [])
    spec = DeploymentSpec.parse("demo", "llm", raw)
    rendered = RenderedDeployment(spec, pod_ip="10.0.3.7")
    for role_name in names.ROLES:
        group = names.group_selector(spec.name, role_name, 0)
        pods = [pod for pod in rendered.pods() if group.items() <= pod["metadata"]["labels"].items()]
        pod = rng.choice(pods)
        container = pod["spec"]["containers"][0]
        argv = [expand(arg, container_env(rendered, pod, container, {})) for arg in container["args"]]
        resolved = resolve_serve_config(_with_model(flags_from_args(build_parser().parse_args(argv)), v3_node))
        layout = resolved.group
        assert layout.local_ranks == len(devices) == 8 and layout.nnodes > 1, argv
        got = [rank_config(resolved, rank).worker.transport for rank in layout.node_ranks]
        assert [t.mooncake_protocol for t in got] == [protocol] * 8
        want = devices if protocol == "rdma" else [""] * 8
        assert [t.mooncake_device for t in got] == want, (role_name, argv)
