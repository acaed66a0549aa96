"""Test helpers: where the router must send requests, read off built or stored manifests.

They rely only on what Kubernetes does with the objects (StatefulSet pod `<sts>-0`, per-pod DNS
`<pod>.<serviceName>.<ns>.svc` through a headless Service), not on the operator's naming rules,
and on the real gateway's argument parser for what the router was told.
"""
from __future__ import annotations

from typing import Any

from deepseek_pd.operator import names


def leader_urls(objects: list[dict[str, Any]], role: str) -> list[str]:
    """gRPC URL of rank 0 of each StatefulSet of `role` among `objects`, in group-index order."""
    services = {m["metadata"]["name"]: m for m in objects if m["kind"] == "Service"}
    found = []
    for sts in objects:
        labels = sts["metadata"].get("labels", {})
        if sts["kind"] != "StatefulSet" or labels.get(names.LABEL_ROLE) != role:
            continue
        service = services[sts["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None"  # per-pod DNS records exist only if headless
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
        container = sts["spec"]["template"]["spec"]["containers"][0]
        assert port in [p["containerPort"] for p in container["ports"]]
        meta = sts["metadata"]
        host = f"{meta['name']}-0.{service['metadata']['name']}.{meta['namespace']}.svc"
        found.append((int(labels[names.LABEL_GROUP_INDEX]), f"grpc://{host}:{port}"))
    return [url for _, url in sorted(found)]


def router_flags(deployment: dict[str, Any]):
    """The router Deployment's arguments, parsed by sgl-model-gateway's own launcher."""
    from smg.launch_router import parse_router_args

    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["-m", "smg.launch_router"]
    return parse_router_args(args[2:])


def router_worker_urls(deployment: dict[str, Any]) -> dict[str, list[str]]:
    """role -> the worker URLs the router was given (prefill without its bootstrap port)."""
    parsed = router_flags(deployment)
    return {"prefill": [url for url, _ in parsed.prefill_urls], "decode": list(parsed.decode_urls)}
