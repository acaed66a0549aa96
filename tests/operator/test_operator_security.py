"""The rendered pods start with internal authentication on and are locked down (pure builders).

Oracles: `deepseek-pd serve`'s own resolution for the worker argv/env, smg's own parser for the
router argv, the decode worker's own allowlist (PrefillPeers) for the router's prefill addresses,
and a direct reading of the NetworkPolicy semantics for who may reach which port.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import ipaddress
import json
import os
import pathlib
import random
import re
import socket

import pytest
import yaml
from leader_urls import router_flags

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.errors import UserError
from deepseek_pd.operator import names
from deepseek_pd.env import MOONCAKE_RPC_PORTS
from deepseek_pd.operator.build_metrics import worker_metrics_port_numbers
from deepseek_pd.operator.build_network_policy import build_network_policy
from deepseek_pd.operator.build_router import build_router_args, build_router_deployment
from deepseek_pd.operator.build_secret import build_internal_secret
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.crd_spec import DEFAULT_RUN_AS_USER
from deepseek_pd.operator.pod_security import secure_container
from deepseek_pd.operator.router_keys import build_control_plane_secret
from deepseek_pd.operator.spec import DeploymentSpec, InvalidSpecError
from deepseek_pd.workers.transport.internal_auth import SECRET_FILE_ENV
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.decode.prefill_peers import PrefillPeers

pytestmark = pytest.mark.timeout(120)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _raw(example: str = "cpu-minimal.yaml") -> dict:
    return yaml.safe_load((EXAMPLES / example).read_text())["spec"]


def _spec(raw: dict, name: str = "tiny", namespace: str = "llm") -> DeploymentSpec:
    return DeploymentSpec.parse(name, namespace, raw)


def _pod(spec: DeploymentSpec, role: str, index: int = 0) -> dict:
    return build_group_statefulset(spec, role, index)["spec"]["template"]


def _all_pods(spec: DeploymentSpec) -> list[dict]:
    return [_pod(spec, "prefill"), _pod(spec, "decode"), build_router_deployment(spec)["spec"]["template"]]


# ---- decode's allowlist against what the router is told --------------------------------------

def _fake_dns(monkeypatch, table: dict[str, list[str]]) -> list[str]:
    """Cluster DNS for the test: `table` names resolve, nothing else does. Returns the name lookups.

    IP literals are not recorded: they need no DNS, and threads other tests left running in this
    process (a client dialing 127.0.0.1) go through the same patched function.
    """
    lookups: list[str] = []
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if _is_ip_literal(host):
            return real_getaddrinfo(host, port, *args, **kwargs)
        lookups.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in table[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return lookups


def _is_ip_literal(host) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _peers_of(pod: dict) -> tuple[str, ...]:
    args = pod["spec"]["containers"][0]["args"]
    return tuple(args[args.index("--prefill-peers") + 1].split(","))


def _check(peers: PrefillPeers, host: str, port: int) -> bool:
    try:
        asyncio.run(peers.check(host, port))
        return True
    except TransferError:
        return False


def test_decode_accepts_every_prefill_group_the_router_names_even_after_scaling(monkeypatch):
    lookups = _fake_dns(monkeypatch, {})
    raw = _raw()
    raw["prefill"]["replicas"] = random.randint(1, 4)
    raw["prefill"]["bootstrapPort"] = port = random.randint(9000, 9999)
    name = random.choice(["tiny", "v3", "chat-7"])
    spec = _spec(raw, name=name)
    decode = _pod(spec, "decode")
    assert "--prefill-peers" not in _pod(spec, "prefill")["spec"]["containers"][0]["args"]
    peers = PrefillPeers(_peers_of(decode))
    raw["prefill"]["replicas"] += random.randint(1, 20)  # scaled up after the decode pod started
    scaled = _spec(raw, name=name)
    prefill_urls = router_flags(build_router_deployment(scaled)).prefill_urls
    assert len(prefill_urls) == raw["prefill"]["replicas"]
    for url, bootstrap in prefill_urls:
        host = re.match(r"grpc://([^:/]+):\d+$", url).group(1)
        assert bootstrap == port and _check(peers, host, bootstrap), url
    assert lookups == []  # the router's names match as text: no DNS on the request path
    # Not this deployment's prefill workers: another name, namespace or port, a decode leader.
    first = re.match(r"grpc://([^:/]+):", prefill_urls[0][0]).group(1)
    for host, bad_port in ((first.replace(f"{name}-", f"x{name}-"), port), (first.replace(".llm.", ".other."), port),
                           (first, port + 1), (first.replace("-prefill-", "-decode-"), port),
                           ("10.0.0.7", port), (first + ".evil.example", port)):
        assert not _check(peers, host, bad_port), host


def test_decode_accepts_prefill_pod_ips_through_the_prefill_peers_service(monkeypatch):
    """A router that discovers pods by label hands decode pod IPs: the headless Service over every
    prefill pod resolves to them (emulated DNS), and nothing else is accepted."""
    spec = _spec(_raw())
    pod_ips = [f"10.1.{random.randint(0, 255)}.{i}" for i in range(1, 4)]
    peers_service = f"{names.prefill_peers_service_name('tiny')}.llm.svc"
    _fake_dns(monkeypatch, {peers_service: pod_ips})
    peers = PrefillPeers(_peers_of(_pod(spec, "decode")))
    port = spec.prefill.bootstrap_port
    assert all(_check(peers, ip, port) for ip in pod_ips)
    assert not _check(peers, "10.2.0.1", port) and not _check(peers, pod_ips[0], port + 1)


# ---- serve resolves the rendered pod, and refuses it without the mounted secret ---------------

def _kubelet_mounts(pod: dict, root: pathlib.Path, secrets: dict[str, dict], model_dir: pathlib.Path) -> None:
    """What the kubelet does with the pod's volumes, under `root`: a Secret volume as its atomic
    writer lays it out (..data symlink, files in defaultMode; fsGroup adds group read), the model
    volume as the tiny checkpoint."""
    spec = pod["spec"]
    container = spec["containers"][0]
    fs_group = spec.get("securityContext", {}).get("fsGroup")
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        target = root / mount["mountPath"].lstrip("/")
        if "secret" in volume:
            data = secrets[volume["secret"]["secretName"]]["data"]
            stamp = target / "..2026_12_03_00_00_00.1"
            stamp.mkdir(parents=True)
            for key, value in data.items():
                (stamp / key).write_bytes(base64.b64decode(value))
                mode = volume["secret"]["defaultMode"]
                (stamp / key).chmod(mode | (0o040 if fs_group and mode & 0o400 else 0))
                os.symlink(f"..data/{key}", target / key)
            os.symlink(stamp.name, target / "..data")
        elif mount["mountPath"] == names.MODEL_MOUNT:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(model_dir.parent, target)


def _container_env(pod: dict, root: pathlib.Path) -> dict[str, str]:
    """The container's environment as the kubelet fills it (downward API with made-up values);
    absolute paths are taken below `root`, where _kubelet_mounts put the volumes."""
    env = {}
    for entry in pod["spec"]["containers"][0]["env"]:
        if "value" in entry:
            value = entry["value"]
            env[entry["name"]] = str(root / value.lstrip("/")) if value.startswith("/etc") or \
                value.startswith("/var/run") else value
        else:
            env[entry["name"]] = "0" if "labels" in json.dumps(entry) else "127.0.0.1"
    return env


def _argv(pod: dict, env: dict[str, str], root: pathlib.Path) -> list[str]:
    """The kubelet's $(VAR) expansion, with /models below `root`."""
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in pod["spec"]["containers"][0]["args"]]
    return [str(root / a.lstrip("/")) if a.startswith(names.MODEL_MOUNT + "/") else a for a in args]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> pathlib.Path:
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    return pathlib.Path(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serve_starts_from_the_rendered_pod_and_refuses_it_without_the_secret(
        role, tmp_path, monkeypatch, tiny_checkpoint):
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    spec = _spec(_raw())
    pod = _pod(spec, role)
    secret = build_internal_secret("tiny", "llm")
    _kubelet_mounts(pod, tmp_path, {secret["metadata"]["name"]: secret}, tiny_checkpoint)
    env = _container_env(pod, tmp_path)
    argv = _argv(pod, env, tmp_path)
    assert pod["spec"]["containers"][0]["command"] == ["deepseek-pd"]
    monkeypatch.setenv(SECRET_FILE_ENV, env[SECRET_FILE_ENV])  # the pod's variable, not the tests'
    config = resolve_serve_config(flags_from_args(build_parser().parse_args(argv)))
    assert config.worker.bootstrap.auth.secret == base64.b64decode(secret["data"]["internal.secret"])
    expected_peers = _peers_of(pod) if role == "decode" else ()
    assert config.worker.bootstrap.prefill_peers == expected_peers

    # The same pod without the secret (no volume, no mount, no variable) does not start.
    bare = copy.deepcopy(pod)
    container = bare["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != SECRET_FILE_ENV]
    monkeypatch.delenv(SECRET_FILE_ENV)
    with pytest.raises(UserError, match="internal-secret-file"):
        resolve_serve_config(flags_from_args(build_parser().parse_args(argv)))
    # The variable without the mounted file does not either.
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path / "not-mounted" / "internal.secret"))
    with pytest.raises(UserError, match="cannot read the internal secret file"):
        resolve_serve_config(flags_from_args(build_parser().parse_args(argv)))


@pytest.mark.parametrize("flag", ["--insecure-internal", "--prefill-peers=10.0.0.1:8998",
                                  "--internal-secret-file=/tmp/x"])
def test_engine_args_cannot_override_the_internal_channel(flag):
    raw = _raw()
    raw["decode"]["engineArgs"] = [random.choice(["--chunked-prefill-size=64", "--page-size=16"]), flag]
    with pytest.raises(InvalidSpecError, match="engineArgs must not set flags the operator manages"):
        _spec(raw)


def test_secret_file_is_mounted_read_only_and_owner_readable_only():
    for pod in (_pod(_spec(_raw()), role) for role in names.ROLES):
        container = pod["spec"]["containers"][0]
        volume = next(v for v in pod["spec"]["volumes"] if "secret" in v)
        assert volume["secret"] == {"secretName": "tiny-internal", "defaultMode": 0o400}
        mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
        assert mount["readOnly"] is True
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[SECRET_FILE_ENV].startswith(mount["mountPath"] + "/")
        # Not nested in another volume's mount (a read-only ConfigMap cannot get a mount point).
        others = [m["mountPath"] for m in container["volumeMounts"] if m is not mount]
        assert not any(mount["mountPath"].startswith(o.rstrip("/") + "/") for o in others)


# ---- the security context of every container --------------------------------------------------

@pytest.mark.parametrize("example", ["cpu-minimal.yaml", "deepseek-v3-h200.yaml"])
def test_every_container_is_locked_down(example):
    raw = _raw(example)
    spec = _spec(raw)
    for pod in _all_pods(spec):
        pod_spec = pod["spec"]
        context = pod_spec["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == context["fsGroup"] == DEFAULT_RUN_AS_USER
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        is_router = pod_spec["containers"][0]["name"] == "router"
        assert pod_spec["automountServiceAccountToken"] is False  # Static discovery: no API access
        for container in pod_spec["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            expected_add = list(spec.rdma.capabilities) if spec.rdma_enabled and not is_router else None
            assert sc["capabilities"].get("add") == expected_add
            assert sc["readOnlyRootFilesystem"] is True
            tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
            assert "emptyDir" in next(v for v in pod_spec["volumes"] if v["name"] == tmp["name"])
            assert {"name": "HOME", "value": "/tmp"} in container["env"]


def test_pod_security_knobs_and_helper_containers():
    raw = _raw()
    raw["podSecurity"] = {"runAsUser": 0, "readOnlyRootFilesystem": False}
    spec = _spec(raw)
    for pod in _all_pods(spec):
        assert pod["spec"]["securityContext"] == {"runAsNonRoot": False,
                                                  "seccompProfile": {"type": "RuntimeDefault"}}
        container = pod["spec"]["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is False
        assert all(m["mountPath"] != "/tmp" for m in container["volumeMounts"])
    # An init container added by another builder (e.g. a weights download) is locked down too.
    uid = random.randint(1, 60000)
    pod_spec = {"containers": [{"name": "worker", "args": []}],
                "initContainers": [{"name": "download", "args": []}]}
    secure_container(_spec({**_raw(), "podSecurity": {"runAsUser": uid}}), pod_spec, pod_spec["containers"][0])
    init = pod_spec["initContainers"][0]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod_spec["securityContext"]["runAsUser"] == uid
    assert {"name": "tmp", "mountPath": "/tmp"} in init["volumeMounts"]


def test_selector_router_keeps_its_token_and_nothing_else():
    raw = _raw()
    raw["router"] = {"workerDiscovery": "Selector"}
    pod = build_router_deployment(_spec(raw))["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True  # it watches pods
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


# ---- router keys ------------------------------------------------------------------------------

def test_router_keys_come_from_secrets_and_never_appear_in_the_deployment():
    raw = _raw()
    secret_name, key_name = f"client-keys-{random.randint(0, 999)}", random.choice(["api-key", "token"])
    raw["router"] = {"apiKeySecret": {"name": secret_name, "key": key_name}}
    spec = _spec(raw)
    control = build_control_plane_secret(spec)
    key = base64.b64decode(control["data"]["control-plane-key"]).decode()
    another = build_control_plane_secret(spec)["data"]["control-plane-key"]
    assert len(key) >= 32 and key != base64.b64decode(another).decode()
    deployment = build_router_deployment(spec)
    assert key not in json.dumps(deployment)
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    parsed = router_flags(deployment)
    [(key_id, _, value, role)] = parsed.control_plane_api_keys
    assert role == "admin" and key_id == "deepseek-pd"
    variable = re.fullmatch(r"\$\((\w+)\)", value).group(1)
    assert env[variable]["valueFrom"]["secretKeyRef"] == {"name": control["metadata"]["name"],
                                                          "key": "control-plane-key"}
    client_variable = re.fullmatch(r"\$\((\w+)\)", parsed.api_key).group(1)
    assert env[client_variable]["valueFrom"]["secretKeyRef"] == {"name": secret_name, "key": key_name}
    # Without apiKeySecret the client API stays open (no --api-key); the control plane never is.
    open_args = build_router_args(_spec(_raw()))
    assert "--api-key" not in open_args and "--control-plane-api-keys" in open_args


# ---- the NetworkPolicy ------------------------------------------------------------------------

def _selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def _admits(policy: dict, source: dict[str, str], target: dict[str, str], port: int) -> bool:
    """NetworkPolicy semantics (same namespace, TCP): a selected pod admits a connection when some
    ingress rule has a peer selecting the source and a port entry covering the port."""
    if not _selects(policy["spec"]["podSelector"], target):
        return True  # not isolated by this policy
    for rule in policy["spec"]["ingress"]:
        peers_ok = any(_selects(peer["podSelector"], source) for peer in rule.get("from", []))
        ports_ok = any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule.get("ports", []))
        if peers_ok and ports_ok:
            return True
    return False


@pytest.mark.parametrize("backend,direction", [("grpc", None), ("mooncake", None), ("mooncake", "write")])
def test_network_policy_admits_exactly_the_documented_flows(backend, direction):
    """`direction`: decode's --engine-opt mooncake_kv_direction (None: the default, pulled transfers,
    where only decode pods reach any Mooncake engine: no prefill pod reaches another's staging)."""
    raw = _raw()
    raw["kvTransfer"] = {"backend": backend}
    if direction is not None:
        raw["decode"]["engineArgs"] = [*raw["decode"].get("engineArgs", []), "--engine-opt",
                                       f"mooncake_kv_direction={direction}"]
    raw["prefill"]["port"], raw["decode"]["port"] = random.sample(range(20000, 40000), 2)
    raw["prefill"]["bootstrapPort"] = random.randint(8000, 9999)
    spec = _spec(raw)
    policy = build_network_policy(spec)
    pods = {  # labels as the builders put them on the pods
        "router": build_router_deployment(spec)["spec"]["template"]["metadata"]["labels"],
        "prefill": _pod(spec, "prefill", 1)["metadata"]["labels"],
        "decode": _pod(spec, "decode", 0)["metadata"]["labels"],
        "other-decode": _pod(_spec(raw, name="other"), "decode")["metadata"]["labels"],
        "stranger": {"app": "web"},
        # the chart's operator pod (another namespace): the verified roles' gRPC ports, for verified rollouts
        "operator": {names.LABEL_NAME: names.APP_NAME, names.LABEL_COMPONENT: "operator", "app.kubernetes.io/instance": "x"},
    }
    grpc = {spec.prefill.port, spec.decode.port}
    bootstrap = spec.prefill.bootstrap_port
    ports = grpc | {bootstrap, 5757, 1, 65535} | {p + d for p in grpc | {bootstrap} for d in (-1, 1)}
    ports |= set(random.sample(range(1, 65536), 200))
    # Mooncake's engine range (its ends and random ports inside): open to the deployment's own
    # workers only, through one rule of its own with backend mooncake.
    engines = MOONCAKE_RPC_PORTS
    ports |= {engines.start - 1, engines.start, engines.stop - 1, engines.stop, *random.sample(engines, 50)}
    metrics = set(worker_metrics_port_numbers(spec))
    for target in ("prefill", "decode"):
        for source, labels in pods.items():
            for port in sorted(ports - metrics):
                if port in grpc:
                    verified = {spec.role(r).port for r in names.ROLES if spec.role(r).rollout.verify}
                    expected = source == "router" or (source == "operator" and port in verified)
                elif port == bootstrap:
                    expected = source == "decode"
                elif backend == "mooncake" and port in engines and direction != "write":
                    expected = source == "decode"
                else:
                    expected = source in ("prefill", "decode")
                assert _admits(policy, labels, pods[target], port) == expected, (source, target, port)
    assert not _selects(policy["spec"]["podSelector"], pods["router"])  # the router stays reachable
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    covering = [rule for rule in policy["spec"]["ingress"]
                if any(p["port"] <= engines.start + 1 <= p.get("endPort", p["port"]) for p in rule["ports"])]
    if backend == "mooncake":  # exactly one rule, the range itself, from its peers: readable at a glance
        peers = ({"podSelector": policy["spec"]["podSelector"]} if direction == "write" else
                 {"podSelector": {"matchLabels": {names.LABEL_DEPLOYMENT: spec.name, names.LABEL_ROLE: "decode"}}})
        assert [(r["ports"], r["from"]) for r in covering] == \
            [([{"protocol": "TCP", "port": engines.start, "endPort": engines.stop - 1}], [peers])]


def test_network_policy_extra_rules_are_appended():
    raw = _raw()
    extra = {"from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
             "ports": [{"protocol": "TCP", "port": random.randint(9000, 9100)}]}
    raw["networkPolicy"] = {"additionalIngress": [extra]}
    assert build_network_policy(_spec(raw))["spec"]["ingress"][-1] == extra
