"""The NetworkPolicy of one deployment's worker pods: who may open which port.

    worker gRPC (prefill.port, decode.port)    only from the deployment's router pods, and
                                               from the operator's pod for a role whose
                                               rollouts are verified (<role>.rolloutStrategy.verify)
    prefill bootstrap (prefill.bootstrapPort)  only from the deployment's decode pods
    Mooncake's engines (15000-17000, each      only from the deployment's decode pods: a rule
      rank's RPC and TCP-transport ports,        of its own with kvTransfer.backend mooncake
      drawn at random: env.MOONCAKE_RPC_PORTS)   (every worker pod when decode's engineArgs set
                                                 --engine-opt mooncake_kv_direction=write)
    every other TCP port (NCCL,                only from the deployment's worker pods
      torch.distributed rendezvous 5757)
    the metrics ports (spec.metrics)           from spec.metrics.allowFrom, or anyone (build_metrics)
    spec.networkPolicy.additionalIngress       appended as given

Mooncake's pools answer any peer that reaches an engine port (issue 20: no access control on
registered memory), so the engine range is its own rule: another deployment's pods, the router
and anything outside the namespace never reach it. With pulled transfers (the default) only decode
engines open connections (they read from the prefill engines' send staging; a prefill engine
dials nobody), so prefill pods are kept off every engine port: a compromised prefill pod reaches no
other prefill worker's staging (docs/operations.md §8). One policy selects both roles, so decode
pods also reach decode engines, which over TCP register nothing.

NCCL and Mooncake listen on ports picked at run time, so "every other port" is written as the
ranges between the gRPC and bootstrap ports (`endPort`, Kubernetes >= 1.25); a CNI plugin without
endPort support would allow only each range's first port. Worked example, ports 30000 and 8998,
metrics off, Mooncake:
    15000-17000 from workers (Mooncake);  1-8997, 8999-14999, 17001-29999, 30001-65535 from
    workers;  8998 from decode;  30000 from the router.
Egress is not restricted. Pods on the host network (spec.rdma.hostNetwork) are not subject to
NetworkPolicy at all; RDMA traffic bypasses it too (the HMAC tokens still protect the KV channel).
"""
from __future__ import annotations

from typing import Any

from deepseek_pd.env import MOONCAKE_RPC_PORTS
from deepseek_pd.operator import names
from deepseek_pd.operator.build_metrics import metrics_ingress, worker_metrics_port_numbers
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.workers.serve.flags import ServeFlags

Manifest = dict[str, Any]
MAX_PORT = 65535


def port_ranges_except(excluded: set[int], excluded_ranges: tuple[range, ...] = ()) -> list[tuple[int, int]]:
    """Inclusive ranges covering 1..65535 without `excluded` and the ports of `excluded_ranges`."""
    skip = sorted([(p, p) for p in excluded] + [(r.start, r.stop - 1) for r in excluded_ranges if r])
    ranges, start = [], 1
    for first, last in skip:
        if first > start:
            ranges.append((start, first - 1))
        start = max(start, last + 1)
    if start <= MAX_PORT:
        ranges.append((start, MAX_PORT))
    return ranges


def _tcp(first: int, last: int | None = None) -> dict[str, Any]:
    port: dict[str, Any] = {"protocol": "TCP", "port": first}
    if last is not None and last > first:
        port["endPort"] = last
    return port


def _pods(spec: DeploymentSpec, **labels: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {names.LABEL_DEPLOYMENT: spec.name, **labels}}}


def _workers(spec: DeploymentSpec) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {names.LABEL_DEPLOYMENT: spec.name},
                            "matchExpressions": [{"key": names.LABEL_ROLE, "operator": "In",
                                                  "values": list(names.ROLES)}]}}


def decode_pulls(spec: DeploymentSpec) -> bool:
    """Whether the decode workers read the KV from the prefill workers (Mooncake pulled transfers,
    the default), as they parse their engineArgs; engineArgs they would refuse count as the default
    (those pods do not start)."""
    try:
        options = ServeFlags.from_argv(["decode", *spec.decode.engine_args]).all_engine_options
    except ValueError:
        return True
    return not any(option.replace(" ", "") == "mooncake_kv_direction=write" for option in options)


def build_network_policy(spec: DeploymentSpec) -> Manifest:
    grpc_ports = sorted({spec.prefill.port, spec.decode.port})
    bootstrap = spec.prefill.bootstrap_port
    router = _pods(spec, **{names.LABEL_COMPONENT: "router"})
    decode = _pods(spec, **{names.LABEL_ROLE: "decode"})
    # With Mooncake its engine range is one rule of its own, and only that rule covers it. With grpc
    # nothing of ours listens there, but NCCL may (a node whose ephemeral range starts low), so it
    # stays inside "every other port".
    mooncake = (MOONCAKE_RPC_PORTS,) if spec.kv_transfer.backend == "mooncake" else ()
    engine_peers = decode if decode_pulls(spec) else _workers(spec)
    engines = [{"from": [engine_peers], "ports": [_tcp(r.start, r.stop - 1)]} for r in mooncake]
    # Verified rollouts: the operator's pod (any namespace) sends the check's greedy requests to
    # the leaders of each role it verifies (rollout_verify.py).
    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": {
        names.LABEL_NAME: names.APP_NAME, names.LABEL_COMPONENT: "operator"}}}
    verified = sorted({spec.role(r).port for r in names.ROLES if spec.role(r).rollout.verify})
    checks = [{"from": [operator], "ports": [_tcp(p) for p in verified]}] if verified else []
    ingress = [
        {"from": [router], "ports": [_tcp(p) for p in grpc_ports]},
        *checks,
        {"from": [decode], "ports": [_tcp(bootstrap)]},
        *engines,
        {"from": [_workers(spec)],
         "ports": [_tcp(a, b) for a, b in port_ranges_except({*grpc_ports, bootstrap,
                                                                 *worker_metrics_port_numbers(spec)},
                                                                mooncake)]},
        *metrics_ingress(spec),
        *[dict(rule) for rule in spec.network_policy.additional_ingress],
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": names.network_policy_name(spec.name), "namespace": spec.namespace,
                     "labels": names.base_labels(spec.name, "workers")},
        "spec": {"podSelector": _workers(spec)["podSelector"], "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }
