"""Runs the emulated API server and the real kopf operator in one background event loop.

Tests talk to the emulator over HTTP on 127.0.0.1 (so every write produces watch events, as
in a cluster) with a small synchronous client, and wait with bounded polls.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import kmock
import kopf

from deepseek_pd.operator import names
from deepseek_pd.operator.crd import build_crd
from deepseek_pd.operator.handlers import OperatorConfig, run_operator
from kopf_emulator import ClusterEmulator, Hold

CORE = {"pods": "Pod", "services": "Service", "configmaps": "ConfigMap",
        "serviceaccounts": "ServiceAccount", "events": "Event", "secrets": "Secret",
        "persistentvolumeclaims": "PersistentVolumeClaim"}
APPS = {"statefulsets": "StatefulSet", "deployments": "Deployment"}
RBAC = {"roles": "Role", "rolebindings": "RoleBinding"}
NETWORKING = {"networkpolicies": "NetworkPolicy"}
PATHS = {"Pod": "api/v1/namespaces/{ns}/pods", "Service": "api/v1/namespaces/{ns}/services",
         "ConfigMap": "api/v1/namespaces/{ns}/configmaps",
         "ServiceAccount": "api/v1/namespaces/{ns}/serviceaccounts",
         "PersistentVolumeClaim": "api/v1/namespaces/{ns}/persistentvolumeclaims",
         "Secret": "api/v1/namespaces/{ns}/secrets",
         "NetworkPolicy": "apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
         "StatefulSet": "apis/apps/v1/namespaces/{ns}/statefulsets",
         "Deployment": "apis/apps/v1/namespaces/{ns}/deployments",
         "Role": "apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
         "RoleBinding": "apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
         names.KIND: f"apis/{names.API_VERSION}/namespaces/{{ns}}/{names.PLURAL}"}


def _declare_resources(emulator: ClusterEmulator) -> None:
    verbs = {"get", "list", "watch", "create", "patch", "delete"}
    for plural, kind in CORE.items():
        emulator.resources[f"v1/{plural}"] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=verbs)
    for plural, kind in APPS.items():
        emulator.resources[f"apps/v1/{plural}"] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=verbs)
    for plural, kind in RBAC.items():
        emulator.resources[f"rbac.authorization.k8s.io/v1/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs=verbs)
    for plural, kind in NETWORKING.items():
        emulator.resources[f"networking.k8s.io/v1/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs=verbs)
    # kopf's namespace and CRD observers wait for these two to be discoverable.
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=verbs)
    emulator.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=verbs)
    emulator.resources[f"{names.API_VERSION}/{names.PLURAL}"] = kmock.ResourceInfo(
        kind=names.KIND, singular=names.SINGULAR, namespaced=True, verbs=verbs,
        shortnames=set(names.SHORT_NAMES), subresources={"status"})


class OperatorHarness:
    """`with OperatorHarness() as cluster:` starts both; leaving stops kopf, then the server."""

    def __init__(self, resync_seconds: float = 0.5, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.resync_seconds = resync_seconds
        self.url = ""
        self.emulator: ClusterEmulator | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True, name="operator-harness")
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> OperatorHarness:
        self._thread.start()
        if not self._started.wait(60) or self._error:
            raise RuntimeError(f"operator harness did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "kopf did not stop within 30 s"
        self._loop.close()

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # surfaced to the test through __enter__/__exit__
            self._error = exc
            self._started.set()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with ClusterEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            _declare_resources(emulator)
            self.url = str(server.url).rstrip("/")
            namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}}
            emulator.objects[kmock.resource("", "v1", "namespaces"), None, self.namespace] = namespace
            crds = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
            emulator.objects[crds, None, names.CRD_NAME] = build_crd()
            config = OperatorConfig(resync_seconds=self.resync_seconds,
                                    login=lambda **_: kopf.ConnectionInfo(server=self.url))
            ready = asyncio.Event()
            # Cluster-wide: kmock cannot serve the namespace list a namespaced kopf asks for.
            task = asyncio.create_task(run_operator(config, stop_flag=self._stop, ready_flag=ready))
            await asyncio.wait_for(ready.wait(), 60)
            self._started.set()
            await task

    # ---- a synchronous API client ---------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None,
                 content_type: str = "application/json") -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/{path}", data=data, method=method,
                                     headers={"Content-Type": content_type})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"{}")

    def path(self, kind: str, name: str | None = None) -> str:
        base = PATHS[kind].format(ns=self.namespace)
        return f"{base}/{name}" if name else base

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", self.path(manifest["kind"]), manifest)

    def patch(self, kind: str, name: str, patch: dict[str, Any], subresource: str = "") -> dict:
        path = self.path(kind, name) + (f"/{subresource}" if subresource else "")
        return self._request("PATCH", path, patch, "application/merge-patch+json")

    def delete(self, kind: str, name: str) -> None:
        self._request("DELETE", self.path(kind, name))

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", self.path(kind, name))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def list(self, kind: str) -> list[dict[str, Any]]:
        return self._request("GET", self.path(kind)).get("items", [])

    def names(self, kind: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.list(kind)}

    # ---- forcing an interleaving ---------------------------------------------------------
    def hold_next(self, match: Callable[[Any], bool]) -> Hold:
        """The next request `match` (a kmock Request -> bool) accepts waits until `release`."""
        assert self.emulator is not None
        hold = Hold(match)
        self._loop.call_soon_threadsafe(self.emulator.holds.append, hold)
        return hold

    def release(self, hold: Hold) -> None:
        self._loop.call_soon_threadsafe(hold.released.set)

    # ---- waiting --------------------------------------------------------------------------
    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Polls `check` until it returns something truthy; fails with `what` after `timeout`."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self._error:
                raise RuntimeError(f"operator crashed: {self._error!r}")
            last = check()
            if last:
                return last
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
