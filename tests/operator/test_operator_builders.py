"""Pure manifest builders: Kubernetes-schema valid (kubernetes-validate 1.37) and semantically right."""
from __future__ import annotations

import copy
import json
import math
import pathlib
import random

import pytest
import yaml
from leader_urls import leader_urls, router_flags

from deepseek_pd.operator import names, router_discovery
from deepseek_pd.operator.build_router import build_router_args
from deepseek_pd.operator.build_workers import (
    build_group_service, build_group_statefulset, build_worker_config,
)
from deepseek_pd.operator.crd_spec import WORKER_DISCOVERY_MODES
from deepseek_pd.operator.planner import plan_role
from deepseek_pd.operator.reconcile import build_static_children, role_target
from deepseek_pd.operator.spec import DeploymentSpec
from pdtest.schema_admission import Refused, validate

pytestmark = pytest.mark.timeout(120)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
DISCOVERY = ("Static", "Selector")


def _raw(example: str, discovery: str | None = None) -> dict:
    raw = yaml.safe_load((EXAMPLES / example).read_text())["spec"]
    if discovery is not None:
        raw.setdefault("router", {})["workerDiscovery"] = discovery
    return raw


def _spec(raw: dict, name: str = "v3") -> DeploymentSpec:
    return DeploymentSpec.parse(name, "llm", raw)


def _all_children(spec: DeploymentSpec) -> list[dict]:
    out = build_static_children(spec)
    for role in names.ROLES:
        for index in range(spec.role(role).replicas):
            out += [build_group_statefulset(spec, role, index), build_group_service(spec, role, index)]
    return out


def _random_raw(rng: random.Random) -> dict:
    raw = _raw(rng.choice(["deepseek-v3-h200.yaml", "cpu-minimal.yaml"]), rng.choice(DISCOVERY))
    for role in ("prefill", "decode"):
        gpus = rng.choice([0, 1, 8])
        size = rng.choice([1, 2, 3])
        world = size * max(gpus, 1)
        raw[role].update(replicas=rng.randint(0, 3), size=size, gpusPerPod=gpus,
                         parallelism={"dp": 1, "ep": 1}, deepepMode="none" if not gpus else "auto",
                         engineArgs=[f"--page-size={rng.choice([16, 64])}"])
        raw[role]["parallelism"]["tp"] = world
    raw.get("model", {}).pop("numRoutedExperts", None)
    return raw


@pytest.mark.parametrize("discovery", DISCOVERY)
@pytest.mark.parametrize("example", ["deepseek-v3-h200.yaml", "cpu-minimal.yaml"])
def test_every_child_of_the_examples_is_schema_valid(example, discovery):
    for manifest in _all_children(_spec(_raw(example, discovery))):
        validate(manifest)


def test_random_specs_build_schema_valid_children():
    rng = random.Random()
    for _ in range(6):
        spec = _spec(_random_raw(rng), name=f"r{rng.randint(0, 999)}")
        for manifest in _all_children(spec):
            validate(manifest)


def test_validator_is_able_to_reject():
    sts = build_group_statefulset(_spec(_raw("cpu-minimal.yaml")), "decode", 0)
    sts["spec"]["podManagementPolicy"] = 3
    with pytest.raises(Refused):
        validate(sts)


def test_group_statefulset_is_a_gang_with_lws_env():
    spec = _spec(_raw("deepseek-v3-h200.yaml"))
    index = random.randint(0, 5)
    sts = build_group_statefulset(spec, "decode", index)
    group = names.group_name("v3", "decode", index)
    pod = sts["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert sts["metadata"]["name"] == group and sts["spec"]["serviceName"] == group
    assert sts["spec"]["replicas"] == spec.decode.size == 4
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    selector = sts["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    env = {e["name"]: e for e in container["env"]}
    assert env["LWS_LEADER_ADDRESS"]["value"] == f"{group}-0.{group}.llm.svc"
    assert env["LWS_GROUP_SIZE"]["value"] == "4"
    assert env["LWS_WORKER_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        f"metadata.labels['{names.LABEL_POD_INDEX}']"
    assert env["MC_GID_INDEX"]["value"] == "3" and env["MC_FORCE_TCP"]["value"] == "false"
    args = container["args"]
    assert args[:2] == ["serve", "decode"] and container["command"] == ["deepseek-pd"]
    flags = dict(zip(args[2::2], args[3::2]))
    assert flags["--dp"] == "32" and flags["--ep"] == "32" and flags["--nnodes"] == "4"
    assert flags["--node-rank"] == "$(LWS_WORKER_INDEX)" and flags["--device"] == "cuda"
    assert "--bootstrap-port" not in flags
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "8" and resources["limits"]["rdma/ib"] == "1"
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= spec.decode.startup_timeout_seconds
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_prefill_pods_carry_the_bootstrap_port_for_the_router():
    raw = _raw("deepseek-v3-h200.yaml")
    port = random.randint(9000, 9999)
    raw["prefill"]["bootstrapPort"] = port
    sts = build_group_statefulset(_spec(raw), "prefill", 1)
    pod = sts["spec"]["template"]
    assert pod["metadata"]["annotations"][names.ANNOTATION_BOOTSTRAP_PORT] == str(port)
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--bootstrap-port") + 1] == str(port)
    service = build_group_service(_spec(raw), "prefill", 1)
    assert port in [p["port"] for p in service["spec"]["ports"]]


def test_cpu_pods_ask_for_no_gpu_and_no_rdma():
    spec = _spec(_raw("cpu-minimal.yaml"), name="tiny")
    container = build_group_statefulset(spec, "prefill", 0)["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert "add" not in container["securityContext"]["capabilities"]  # IPC_LOCK only with RDMA
    assert container["args"][container["args"].index("--device") + 1] == "cpu"
    assert "--nnodes" not in container["args"] and "--tp" not in container["args"]


def test_headless_service_publishes_not_ready_leaders():
    spec = _spec(_raw("deepseek-v3-h200.yaml"))
    service = build_group_service(spec, "prefill", 0)
    sts = build_group_statefulset(spec, "prefill", 0)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]


def _router_children(spec: DeploymentSpec, groups=None) -> dict[str, dict]:
    return {m["kind"]: m for m in build_static_children(spec, groups)
            if m["metadata"]["name"] == names.router_name(spec.name)}


def test_static_router_lists_every_group_leader_over_grpc():
    rng = random.Random()
    raw = _raw("deepseek-v3-h200.yaml", "Static")
    raw["prefill"].update(replicas=rng.randint(1, 4), port=rng.randint(20000, 29999),
                          bootstrapPort=rng.randint(9000, 9999))
    raw["decode"].update(replicas=rng.randint(1, 4), port=rng.randint(30000, 39999))
    spec = _spec(raw)
    children = _all_children(spec)
    router = _router_children(spec)
    parsed = router_flags(router["Deployment"])
    assert not parsed.service_discovery and parsed.pd_disaggregation
    assert parsed.prefill_urls == [(url, raw["prefill"]["bootstrapPort"])
                                   for url in leader_urls(children, "prefill")]
    assert parsed.decode_urls == leader_urls(children, "decode")
    assert len(parsed.decode_urls) == raw["decode"]["replicas"]
    # A worker still loading when the router starts must not be given up on.
    assert parsed.worker_startup_timeout_secs > max(spec.prefill.startup_timeout_seconds,
                                                    spec.decode.startup_timeout_seconds)
    # ... and one that comes up is registered before a health check could have noticed it, not
    # after smg's default 30 s between start-up checks (the router pod starts first).
    assert parsed.worker_startup_check_interval < parsed.health_check_interval_secs
    # No Kubernetes API access at all: no Role, no binding, no token in the pod.
    assert set(router) == {"ServiceAccount", "Deployment", "Service"}
    pod = router["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == router["ServiceAccount"]["metadata"]["name"]


def test_static_router_lists_the_groups_it_is_given():
    """During a surge rollout or a scale change the router serves the planner's groups."""
    from smg.launch_router import parse_router_args

    spec = _spec(_raw("cpu-minimal.yaml", "Static"), name="tiny")
    groups = {"prefill": [0], "decode": sorted(random.sample(range(6), k=random.randint(1, 4)))}
    children = [build(spec, role, index) for role, indices in groups.items() for index in indices
                for build in (build_group_statefulset, build_group_service)]
    parsed = parse_router_args(build_router_args(spec, {r: i[::-1] for r, i in groups.items()})[2:])
    assert [url for url, _ in parsed.prefill_urls] == leader_urls(children, "prefill")
    assert parsed.decode_urls == leader_urls(children, "decode")  # in index order, deterministic


def test_selector_router_watches_leaders_with_least_privilege():
    spec = _spec(_raw("deepseek-v3-h200.yaml", "Selector"))
    children = _router_children(spec)
    args = build_router_args(spec)
    assert {"--pd-disaggregation", "--service-discovery"} <= set(args)
    assert "--prefill" not in args and "--decode" not in args
    for role in names.ROLES:
        start = args.index(f"--{role}-selector") + 1
        selectors = set(args[start:start + 3])
        assert selectors == {f"{k}={v}" for k, v in names.router_pod_selector("v3", role).items()}
        assert f"{names.LABEL_POD_INDEX}=0" in selectors
    assert args[args.index("--service-discovery-namespace") + 1] == "llm"
    assert children["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                                          "verbs": ["get", "list", "watch"]}]
    pod = children["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == children["ServiceAccount"]["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True
    assert children["RoleBinding"]["subjects"][0]["name"] == pod["serviceAccountName"]
    assert children["RoleBinding"]["roleRef"]["name"] == children["Role"]["metadata"]["name"]
    assert children["Deployment"]["spec"]["replicas"] == 2


def test_router_is_ready_only_with_workers_alive_without_and_drains_when_replaced():
    deployment = _router_children(_spec(_raw("cpu-minimal.yaml")))["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["terminationGracePeriodSeconds"] > router_flags(deployment).shutdown_grace_period_secs
    port_names = {p["name"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert container["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert {container["readinessProbe"]["httpGet"]["port"],
            container["livenessProbe"]["httpGet"]["port"]} <= port_names


def test_discovery_registry_matches_the_crd_enum():
    assert set(router_discovery.WORKER_DISCOVERY) == set(WORKER_DISCOVERY_MODES)


def test_worker_configmap_holds_the_rendered_config():
    spec = _spec(_raw("deepseek-v3-h200.yaml"))
    maps = {m["metadata"]["name"]: m for m in build_static_children(spec) if m["kind"] == "ConfigMap"}
    for role in names.ROLES:
        data = json.loads(maps[names.config_map_name("v3", role)]["data"][names.WORKER_CONFIG_FILE])
        assert data == build_worker_config(spec, spec.role(role))
    assert data["kvTransfer"]["devices"][0] == "mlx5_0"


def test_revision_changes_only_with_what_shapes_the_pods():
    raw = _raw("deepseek-v3-h200.yaml")
    base = _spec(raw)
    scaled = copy.deepcopy(raw)
    scaled["decode"]["replicas"] = 7
    scaled["decode"]["rolloutStrategy"] = {"maxSurge": 2, "maxUnavailable": 0}
    assert _spec(scaled).role_revision("decode") == base.role_revision("decode")
    tuned = copy.deepcopy(raw)
    tuned["decode"]["engineArgs"] = ["--num-pages=4096"]
    assert _spec(tuned).role_revision("decode") != base.role_revision("decode")
    assert _spec(tuned).role_revision("prefill") == base.role_revision("prefill")
    image = copy.deepcopy(raw)
    image["image"] = "other:1"
    assert all(_spec(image).role_revision(r) != base.role_revision(r) for r in names.ROLES)


def test_builders_are_deterministic():
    raw = _raw("deepseek-v3-h200.yaml")
    assert _all_children(_spec(raw)) == _all_children(_spec(copy.deepcopy(raw)))


def test_percent_rollout_resolves_like_deployments():
    raw = _raw("cpu-minimal.yaml")
    raw["decode"]["replicas"] = 10
    raw["decode"]["rolloutStrategy"] = {"maxSurge": "25%", "maxUnavailable": "25%"}
    surge, unavailable = _spec(raw).decode.rollout.resolve(10)
    assert (surge, unavailable) == (math.ceil(2.5), math.floor(2.5))
    raw["decode"]["rolloutStrategy"] = {"maxSurge": "0%", "maxUnavailable": "10%"}
    assert _spec(raw).decode.rollout.resolve(3) == (0, 1)  # never stuck at 0/0


def test_a_rollout_budget_past_the_group_count_is_the_group_count():
    """`make fuzz` (seed 12) drew maxSurge 2**31 - 1, which the CRD admits: the planner's set of
    surge indices filled the host's memory and the kernel killed the test. A percentage as long
    as the schema admits overflowed a float."""
    raw = _raw("cpu-minimal.yaml")
    raw["decode"]["replicas"] = 3
    raw["decode"]["rolloutStrategy"] = {"maxSurge": 2**31 - 1, "maxUnavailable": 2**40}
    assert _spec(raw).decode.rollout.resolve(3) == (3, 3)
    raw["decode"]["rolloutStrategy"] = {"maxSurge": "9" * 400 + "%", "maxUnavailable": "1" + "0" * 400 + "%"}
    assert _spec(raw).decode.rollout.resolve(3) == (3, 3)
    assert plan_role(role_target(_spec(raw), "decode"), {}).replicas == 3  # in no time, in no memory


@pytest.mark.parametrize("example", ["cpu-minimal.yaml", "deepseek-v3-h200.yaml"])
def test_the_pods_grace_period_outlasts_the_workers_own_shutdown(example):
    """The kubelet SIGKILLs a pod at its terminationGracePeriodSeconds: it must outlast the
    worker's whole shutdown (the drain a scale-down counts on, then the worker's own stop graces,
    read from the worker), or a raised --drain-timeout cuts the running streams at 60 s."""
    from deepseek_pd.workers.api.server import ServerConfig
    from deepseek_pd.workers.serve.group_main import STOP_GRACE_S

    for drain in (None, random.uniform(1, 40), random.uniform(50, 900)):
        raw = _raw(example)
        args = [] if drain is None else random.choice([[f"--drain-timeout={drain}"], ["--drain-timeout", str(drain)]])
        for role in names.ROLES:
            raw[role]["engineArgs"] = [*raw[role].get("engineArgs", []), *args]
        spec = _spec(raw)
        worker_bound = (30.0 if drain is None else drain) + ServerConfig.stop_grace_s + STOP_GRACE_S
        for role in names.ROLES:
            pod = build_group_statefulset(spec, role, 0)["spec"]["template"]["spec"]
            assert pod["terminationGracePeriodSeconds"] >= max(60, worker_bound + 5), (drain, pod["terminationGracePeriodSeconds"])
            assert pod["terminationGracePeriodSeconds"] <= max(60, worker_bound + 30)  # not unbounded
