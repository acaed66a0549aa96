"""A small synchronous Kubernetes REST client for the tests and the process kubelet.

Standard library only (urllib + ssl), bearer-token authentication against the test CA. It is not
the operator's client (operator/kube.py) on purpose: the harness must not share code with what it
checks.
"""
from __future__ import annotations

import json
import pathlib
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import yaml

Obj = dict[str, Any]


class KubeError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        message = body.get("message", body) if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")


@dataclass(frozen=True)
class Credentials:
    server: str
    token: str
    ca_path: pathlib.Path

    def kubeconfig(self, path: pathlib.Path, user: str, namespace: str = "default") -> pathlib.Path:
        """Writes a kubeconfig for these credentials (what helm, kubectl and kopf read)."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.server,
                                                      "certificate-authority": str(self.ca_path)}}],
            "users": [{"name": user, "user": {"token": self.token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user,
                                                      "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path


class Kube:
    def __init__(self, creds: Credentials, timeout_s: float = 20.0) -> None:
        self.creds = creds
        self._timeout = timeout_s
        self._ssl = ssl.create_default_context(cafile=str(creds.ca_path))

    def request(self, method: str, path: str, body: Any = None, *,
                content_type: str = "application/json", params: dict[str, str] | None = None) -> Obj:
        url = self.creds.server.rstrip("/") + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self.creds.token}", "Accept": "application/json",
            "Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._ssl) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                detail = json.loads(raw)
            except ValueError:
                detail = raw.decode(errors="replace")
            raise KubeError(exc.code, detail) from None
        return json.loads(raw) if raw else {}

    # Paths: "/api/v1/namespaces/NS/pods", "/apis/apps/v1/namespaces/NS/statefulsets", ...
    def get(self, path: str) -> Obj | None:
        try:
            return self.request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, path: str, **params: str) -> list[Obj]:
        return self.request("GET", path, params=params or None).get("items") or []

    def create(self, path: str, obj: Obj) -> Obj:
        return self.request("POST", path, obj)

    def merge_patch(self, path: str, patch: Obj) -> Obj:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, path: str, **options: Any) -> bool:
        try:
            self.request("DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1", **options})
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
