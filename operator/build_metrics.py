"""Pure builders for scraping: the workers' and the router's metrics flags, ports and annotations,
and the optional ServiceMonitor (`spec.metrics`).

One worker pod runs one process per GPU (`gpusPerPod`; one on CPU), and each rank serves its own
/metrics on `metrics.port + local rank` (workers/metrics/server.py), so a pod exposes

    gpusPerPod 8, metrics.port 30090  ->  container ports metrics:30090, metrics-r1:30091 ... metrics-r7:30097
    annotations prometheus.io/scrape=true, prometheus.io/port=30090, prometheus.io/path=/metrics

The annotations (the common `kubernetes-pods` scrape job) name one port, so they reach rank 0 of
each pod, which also counts every request of its group; the ServiceMonitor, or a PodMonitor of
your own on the `metrics*` port names, reaches every rank.
"""
from __future__ import annotations

from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec, RoleSpec

Manifest = dict[str, Any]

METRICS_PATH = "/metrics"
ROUTER_PORT_NAME = "metrics"


def ranks_per_pod(role: RoleSpec) -> int:
    return max(role.gpus_per_pod, 1)


def worker_port_names(role: RoleSpec) -> list[str]:
    """`metrics` for a pod's first rank, `metrics-r<k>` for the others (port names: 15 chars at most)."""
    return ["metrics"] + [f"metrics-r{k}" for k in range(1, ranks_per_pod(role))]


def worker_metrics_ports(spec: DeploymentSpec, role: RoleSpec) -> list[dict[str, Any]]:
    if not spec.metrics.enabled:
        return []
    return [{"name": name, "containerPort": spec.metrics.port + k, "protocol": "TCP"}
            for k, name in enumerate(worker_port_names(role))]


def worker_metrics_port(spec: DeploymentSpec) -> int | None:
    """`serve --metrics-port` (None: off); the exporter binds `--host` (0.0.0.0 in a pod)."""
    return spec.metrics.port if spec.metrics.enabled else None


def router_metrics_args(spec: DeploymentSpec) -> list[str]:
    """smg always starts its exporter (default 127.0.0.1:29000); in a pod it must listen on every address."""
    if not spec.metrics.enabled:
        return []
    return ["--prometheus-host", "0.0.0.0", "--prometheus-port", str(spec.metrics.router_port)]


def router_metrics_ports(spec: DeploymentSpec) -> list[dict[str, Any]]:
    if not spec.metrics.enabled:
        return []
    return [{"name": ROUTER_PORT_NAME, "containerPort": spec.metrics.router_port, "protocol": "TCP"}]


def scrape_annotations(spec: DeploymentSpec, port: int) -> dict[str, str]:
    if not spec.metrics.enabled:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": METRICS_PATH}


def worker_metrics_port_numbers(spec: DeploymentSpec) -> set[int]:
    """Every port a worker pod of either role may serve metrics on."""
    return {p["containerPort"] for role in (spec.prefill, spec.decode) for p in worker_metrics_ports(spec, role)}


def metrics_ingress(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The NetworkPolicy ingress rule that lets scrapers reach the workers' metrics ports: from
    `metrics.allowFrom` (NetworkPolicyPeers), or from anywhere when it is empty (the annotations
    invite any Prometheus). A policy that keeps other ports to the deployment's own pods must
    leave these ports out of those ranges and append this rule."""
    ports = sorted(worker_metrics_port_numbers(spec))
    if not ports:
        return []
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": ports[0], **(
        {"endPort": ports[-1]} if ports[-1] > ports[0] else {})}]}
    if spec.metrics.allow_from:
        rule["from"] = [dict(peer) for peer in spec.metrics.allow_from]
    return [rule]


def build_service_monitor(spec: DeploymentSpec) -> Manifest | None:
    """One ServiceMonitor over the deployment's group Services (every rank's port) and the router
    Service; None unless `metrics.serviceMonitor`."""
    if not (spec.metrics.enabled and spec.metrics.service_monitor):
        return None
    port_names = list(dict.fromkeys(worker_port_names(spec.prefill) + worker_port_names(spec.decode)
                                    + [ROUTER_PORT_NAME]))
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": spec.name, "namespace": spec.namespace,
                     "labels": names.base_labels(spec.name, "metrics")},
        "spec": {
            "selector": {"matchLabels": {names.LABEL_DEPLOYMENT: spec.name}},
            "namespaceSelector": {"matchNames": [spec.namespace]},
            # A Service without one of these ports (a decode Service has no metrics-r7 when only
            # prefill pods run 8 ranks) simply has no target for it.
            "endpoints": [{"port": name, "path": METRICS_PATH, "interval": "15s"} for name in port_names],
        },
    }
