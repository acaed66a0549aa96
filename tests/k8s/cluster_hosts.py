"""The cluster DNS of the process kubelet, as an /etc/hosts file every pod gets.

Built from the same objects CoreDNS reads, the EndpointSlices the real endpointslice controller
writes, so a name resolves only when Kubernetes says it should:

    <hostname>.<service>.<ns>.svc[.cluster.local]   an endpoint with a hostname (StatefulSet pods
                                                     behind their headless Service)
    <service>.<ns>.svc[.cluster.local], <service>.<ns>
                                                     headless: every ready endpoint; ClusterIP: the
                                                     first ready endpoint's pod IP (no kube-proxy,
                                                     so the name points at a pod, and the Service's
                                                     port must equal its targetPort)

Endpoints count when `conditions.ready` is not false (publishNotReadyAddresses makes the
controller mark them ready). Short names (`<service>` alone, via search domains) are not written.
"""
from __future__ import annotations

from typing import Any

from kube_rest import Kube

Obj = dict[str, Any]
SERVICE_LABEL = "kubernetes.io/service-name"
DOMAIN = "cluster.local"
HEADER = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def _names(*parts: str) -> list[str]:
    base = ".".join(parts)
    return [f"{base}.svc", f"{base}.svc.{DOMAIN}"]


def cluster_entries(kube: Kube) -> list[tuple[str, str]]:
    """(ip, name) pairs for every Service with endpoints, in a stable order."""
    services = {(s["metadata"]["namespace"], s["metadata"]["name"]): s
                for s in kube.list("/api/v1/services")}
    entries: list[tuple[str, str]] = []
    for slice_ in sorted(kube.list("/apis/discovery.k8s.io/v1/endpointslices"),
                         key=lambda s: (s["metadata"]["namespace"], s["metadata"]["name"])):
        namespace = slice_["metadata"]["namespace"]
        service_name = (slice_["metadata"].get("labels") or {}).get(SERVICE_LABEL)
        service = services.get((namespace, service_name or ""))
        if service is None or slice_.get("addressType") != "IPv4":
            continue
        ready = [e for e in slice_.get("endpoints") or []
                 if (e.get("conditions") or {}).get("ready") is not False and e.get("addresses")]
        for endpoint in ready:
            if endpoint.get("hostname"):
                for name in _names(endpoint["hostname"], service_name, namespace):
                    entries.append((endpoint["addresses"][0], name))
        headless = (service.get("spec") or {}).get("clusterIP") == "None"
        chosen = ready if headless else ready[:1]
        for endpoint in chosen:
            for name in [*_names(service_name, namespace), f"{service_name}.{namespace}"]:
                entries.append((endpoint["addresses"][0], name))
    return entries


def hosts_file(entries: list[tuple[str, str]], pod_ip: str = "", hostname: str = "") -> str:
    """The text of one pod's /etc/hosts: localhost, the pod itself, then the cluster's names."""
    lines = [HEADER]
    if pod_ip and hostname:
        lines.append(f"{pod_ip}\t{hostname}\n")
    lines += [f"{ip}\t{name}\n" for ip, name in entries]
    return "".join(lines)
