"""A minimal asynchronous Kubernetes REST client for the kinds the operator manages.

kopf owns its own connection for watching; this client reuses the same credentials (a
`kopf.ConnectionInfo` from the same login function) for creating, patching and deleting children.
It speaks JSON merge-patch only, and filters listed objects by labels locally as well, so it
behaves the same against emulators that ignore `labelSelector`.
"""
from __future__ import annotations

import json

import ssl
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
import kopf

from deepseek_pd.operator import names

# kind -> (API path prefix, plural). Only what the operator touches, mirroring the chart's RBAC.
RESOURCES: dict[str, tuple[str, str]] = {
    "Pod": ("api/v1", "pods"),
    "Service": ("api/v1", "services"),
    "ConfigMap": ("api/v1", "configmaps"),
    "ServiceAccount": ("api/v1", "serviceaccounts"),
    "PersistentVolumeClaim": ("api/v1", "persistentvolumeclaims"),
    "StatefulSet": ("apis/apps/v1", "statefulsets"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "Secret": ("api/v1", "secrets"),  # get/create/delete by name only (operator/secret_reconcile.py)
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies"),
    "Role": ("apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    # Optional (spec.metrics.serviceMonitor): a cluster without the Prometheus Operator answers 404.
    "ServiceMonitor": ("apis/monitoring.coreos.com/v1", "servicemonitors"),
    # Optional (spec.scheduling.gang): in-tree but beta and off by default; a cluster that does
    # not serve it answers 404.
    "PodGroup": ("apis/scheduling.k8s.io/v1beta1", "podgroups"),
    names.KIND: (f"apis/{names.API_VERSION}", names.PLURAL),
    names.SCALE_KIND: (f"apis/{names.API_VERSION}", names.SCALE_PLURAL),
}


@dataclass
class ApiError(Exception):
    status: int
    reason: str
    message: str

    def __str__(self) -> str:
        return f"HTTP {self.status} {self.reason}: {self.message}"


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    context = ssl.create_default_context(cafile=info.ca_path or None)
    if info.ca_data:
        data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        context.load_verify_locations(cadata=data)
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data or info.private_key_data:  # ssl wants files; keep them private
        cert = _to_file(info.certificate_data) if info.certificate_data else cert
        key = _to_file(info.private_key_data) if info.private_key_data else key
    if cert:
        context.load_cert_chain(cert, key)
    return context


def _to_file(data: str | bytes) -> str:
    handle = tempfile.NamedTemporaryFile(delete=False, suffix=".pem")
    handle.write(data.encode() if isinstance(data, str) else data)
    handle.close()
    return handle.name


class KubeClient:
    """`login()` returns fresh credentials; it is called again once after a 401."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo]) -> None:
        self._login = login
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _connect(self) -> aiohttp.ClientSession:
        if self._session is None or self._info is None:
            self._info = self._login()
            headers = {"Accept": "application/json"}
            if self._info.token:
                headers["Authorization"] = f"{self._info.scheme or 'Bearer'} {self._info.token}"
            auth = (aiohttp.BasicAuth(self._info.username, self._info.password or "")
                    if self._info.username else None)
            self._session = aiohttp.ClientSession(
                headers=headers, auth=auth, timeout=aiohttp.ClientTimeout(total=30),
                connector=aiohttp.TCPConnector(ssl=_ssl_context(self._info)))
        return self._session

    def _url(self, kind: str, namespace: str, name: str | None = None) -> str:
        prefix, plural = RESOURCES[kind]
        url = f"{prefix}/namespaces/{namespace}/{plural}"
        return f"{url}/{name}" if name else url

    async def _request(self, method: str, kind: str, namespace: str, name: str | None = None,
                       **kwargs: Any) -> dict[str, Any]:
        return await self._call(method, self._url(kind, namespace, name), **kwargs)

    async def served(self) -> dict[str, Any]:
        """The discovery document of the DeepSeekDeployment API group: answers only while the
        server is reachable, the credentials are accepted and the CRD is served (readiness)."""
        return await self._call("GET", f"apis/{names.API_VERSION}")

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        for attempt in range(2):
            session = self._connect()
            assert self._info is not None
            url = f"{self._info.server.rstrip('/')}/{path}"
            async with session.request(method, url, **kwargs) as resp:
                if resp.status == 401 and attempt == 0:
                    await self.close()  # rotated token: log in again, once
                    continue
                if resp.status >= 400:
                    # A Status object, or plain text ("404 page not found" for an API group the
                    # server does not serve, e.g. ServiceMonitor without the Prometheus Operator).
                    text = await resp.text()
                    try:
                        body = json.loads(text)
                    except ValueError:
                        body = {"message": text.strip()[:200]}
                    body = body if isinstance(body, dict) else {}
                    raise ApiError(resp.status, body.get("reason", resp.reason or ""),
                                   body.get("message", ""))
                body = await resp.json(content_type=None) if resp.content_length != 0 else {}
                return body or {}
        raise AssertionError("unreachable")

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        body = await self._request("GET", kind, namespace,
                                   params={"labelSelector": names.selector_string(labels)})
        items = body.get("items", []) or []

        def matches(obj: dict) -> bool:
            have = obj.get("metadata", {}).get("labels", {}) or {}
            return all(have.get(k) == v for k, v in labels.items())

        return [{"apiVersion": obj.get("apiVersion"), "kind": kind, **obj}
                for obj in items if matches(obj)]

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", kind, namespace, name)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        return await self._request("POST", manifest["kind"], meta["namespace"], json=manifest)

    async def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self._request("PATCH", kind, namespace, name, json=patch,
                                   headers={"Content-Type": "application/merge-patch+json"})

    async def patch_status(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A merge patch of the status subresource."""
        return await self._call("PATCH", f"{self._url(kind, namespace, name)}/status", json=patch,
                                headers={"Content-Type": "application/merge-patch+json"})

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Background propagation: owned objects are collected by the garbage collector."""
        try:
            await self._request("DELETE", kind, namespace, name,
                                 json={"kind": "DeleteOptions", "apiVersion": "v1",
                                       "propagationPolicy": "Background"})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
