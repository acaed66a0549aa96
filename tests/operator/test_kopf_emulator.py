"""The test emulator (kopf_emulator.py) answers as kube-apiserver does where kopf's behaviour hangs
on it: a DELETE that only marks an object (finalizers left) is a change with a new resourceVersion,
and a JSON patch's `test` ops are checked atomically with the patch they guard."""
from __future__ import annotations

import asyncio
import json
import random
import uuid

import aiohttp
import kmock

from kopf_emulator import ClusterEmulator

CONFIGMAPS = "api/v1/namespaces/llm/configmaps"


async def _serve():
    emulator = ClusterEmulator()
    emulator.resources["v1/configmaps"] = kmock.ResourceInfo(
        kind="ConfigMap", namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"})
    return emulator


async def _call(session: aiohttp.ClientSession, method: str, url: str, body=None,
                content_type: str = "application/json") -> tuple[int, dict]:
    data = None if body is None else json.dumps(body)
    async with session.request(method, url, data=data, headers={"Content-Type": content_type}) as resp:
        text = await resp.text()
        return resp.status, (json.loads(text) if text else {})


def test_a_delete_that_waits_on_finalizers_bumps_the_resource_version() -> None:
    async def run() -> None:
        emulator = await _serve()
        async with emulator, kmock.Server(emulator) as server, aiohttp.ClientSession() as session:
            base = f"{str(server.url).rstrip('/')}/{CONFIGMAPS}"
            name = f"cm-{uuid.uuid4().hex[:8]}"
            status, created = await _call(session, "POST", base, {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "finalizers": ["test/keep"]}})
            assert status in (200, 201), created
            before = created["metadata"]["resourceVersion"]
            status, _ = await _call(session, "DELETE", f"{base}/{name}")
            assert status == 200
            status, marked = await _call(session, "GET", f"{base}/{name}")
            assert status == 200 and marked["metadata"].get("deletionTimestamp"), marked
            assert marked["metadata"]["resourceVersion"] != before, (before, marked["metadata"])
    asyncio.run(run())


def test_json_patch_tests_are_checked_with_the_patch_they_guard() -> None:
    """Two JSON patches that each `test` the same value and then change it: exactly one succeeds,
    even when both arrive while the store is busy (the lock held here)."""
    async def run() -> None:
        emulator = await _serve()
        async with emulator, kmock.Server(emulator) as server, aiohttp.ClientSession() as session:
            base = f"{str(server.url).rstrip('/')}/{CONFIGMAPS}"
            name = f"cm-{uuid.uuid4().hex[:8]}"
            start = str(random.randrange(1000))
            status, _ = await _call(session, "POST", base, {
                "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"x": start}})
            assert status in (200, 201)

            def guarded(new: str) -> list[dict]:
                return [{"op": "test", "path": "/data/x", "value": start},
                        {"op": "replace", "path": "/data/x", "value": new}]

            async with emulator._lock:  # the store is busy: both patches arrive before either applies
                racing = [asyncio.create_task(_call(session, "PATCH", f"{base}/{name}", guarded(new),
                                                    "application/json-patch+json")) for new in ("a", "b")]
                await asyncio.sleep(0.5)
            statuses = sorted(status for status, _ in await asyncio.gather(*racing))
            assert statuses == [200, 422], statuses
            status, final = await _call(session, "GET", f"{base}/{name}")
            assert final["data"]["x"] in ("a", "b"), final
    asyncio.run(run())
