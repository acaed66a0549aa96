"""kmock's KubernetesEmulator with the fixes kopf needs (see ../shared/FACTS.md), for tests only.

Added over the base class:
- metadata.uid, resourceVersion, creationTimestamp and generation on create; resourceVersion on
  every change, generation bumped when a patch touches spec (as the API server does for CRs);
- a `/status` patch changes only `status` (the status subresource contract);
- watches subscribe to the event bus before taking their snapshot, so no event falls between;
- lists carry kind/apiVersion and honour equality-based `labelSelector`;
- core discovery answers groupVersion "v1";
- writes are served one at a time, so a JSON patch's `test` ops are checked with the patch they
  guard (no other write between), as kube-apiserver does;
- a DELETE that only marks the object (finalizers left) bumps its resourceVersion, as any change;
- `holds`: a test may stop one chosen request before it is served (to force an interleaving).
Still missing (and not needed here): controllers, garbage collection, admission validation.
"""
from __future__ import annotations

import asyncio
import datetime
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any, Callable

import attrs
import kmock
from kmock._internal import enums, rendering


_WRITES = (enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE)


def _parse_selector(text: str) -> dict[str, str]:
    pairs = [p for p in (text or "").split(",") if p]
    return dict(p.split("=", 1) for p in pairs)


@attrs.define
class Hold:
    """The first request that `match` accepts waits, before it is served, until `released` is set."""

    match: Callable[[rendering.Request], bool]
    arrived: asyncio.Event = attrs.field(factory=asyncio.Event)
    released: asyncio.Event = attrs.field(factory=asyncio.Event)


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    _versions: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)
    holds: list[Hold] = attrs.field(factory=list, init=False)
    # Serialises writes from their checks here through kmock's own apply (which takes kmock's lock
    # only for the apply itself); reads and watches do not take it.
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    def _key(self, request: rendering.Request) -> tuple:
        return (request.resource, request.namespace, request.name)

    def _current(self, request: rendering.Request) -> dict[str, Any] | None:
        key = self._key(request)
        if key in self._objects and not self._objects[key].deleted:
            return self._objects[key].raw
        return None

    async def _handle(self, request: rendering.Request):
        hold = next((h for h in self.holds if h.match(request)), None)
        if hold is not None:  # before anything is read or written: the request is simply late
            self.holds.remove(hold)
            hold.arrived.set()
            await hold.released.wait()
        # kmock keeps every request for assertions and re-scans that history on each request
        # (quadratic); these tests assert on objects, not requests, so keep only the recent ones.
        if len(self._requests) > 64:
            del self._requests[:-32]
        if request.resource is None or request.action not in _WRITES:
            return await super()._handle(request)
        async with self._write_lock:
            return await self._handle_write(request)

    async def _handle_write(self, request: rendering.Request):
        if request.action == enums.action.DELETE and request.name is not None:
            self._bump_on_marking_delete(request)
        if isinstance(request.data, list):  # JSON patch: honour `test` ops (kopf's finalizer removal)
            self._check_json_patch_tests(request)
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                meta.setdefault("namespace", request.namespace)
                if "generateName" in meta and not meta.get("name"):  # kopf's Events: as the apiserver names them
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta["uid"] = str(uuid.uuid4())
                meta["creationTimestamp"] = datetime.datetime.now(datetime.timezone.utc).strftime(
                    "%Y-%m-%dT%H:%M:%SZ")
                meta["generation"] = 1
                meta["resourceVersion"] = str(next(self._versions))
            elif request.action == enums.action.UPDATE and request.name is not None:
                current = self._current(request) or {}
                if request.subresource == "status":
                    for key in [k for k in data if k not in ("status", "metadata")]:
                        del data[key]
                    data["metadata"] = meta = {}
                elif "spec" in data and current.get("spec") != {**current.get("spec", {}), **data["spec"]}:
                    meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
                meta["resourceVersion"] = str(next(self._versions))
        return await super()._handle(request)

    def _bump_on_marking_delete(self, request: rendering.Request) -> None:
        """A DELETE of an object with finalizers only sets deletionTimestamp (kmock, next): give that
        change a new resourceVersion first, as kube-apiserver does."""
        current = self._current(request)
        meta = (current or {}).get("metadata", {})
        if current is not None and meta.get("finalizers") and not meta.get("deletionTimestamp"):
            self._objects[self._key(request)].patch({"metadata": {"resourceVersion": str(next(self._versions))}})

    def _check_json_patch_tests(self, request: rendering.Request) -> None:
        current = self._current(request)
        for op in request.data:
            if op.get("op") != "test" or current is None:
                continue
            node: Any = current
            for part in op["path"].strip("/").split("/"):
                node = node.get(part) if isinstance(node, dict) else None
            if node != op.get("value"):  # what kube-apiserver answers: 422, which kopf retries on the
                # next event; a 409 here made kopf throttle and drop that event, so a deletion hung
                raise kmock.KubernetesError(status=422, reason="Invalid",
                                            message="the server rejected our request due to an error in our request")
        request.data.append({"op": "replace", "path": "/metadata/resourceVersion",
                             "value": str(next(self._versions))})

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_list(request)
        selector = _parse_selector(request.params.get("labelSelector", ""))
        items = [o for o in payload["items"]
                 if all((o.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in selector.items())]
        resource = request.resource
        info = self.resources[resource] if resource in self.resources else None
        kind = (info.kind if info is not None and info.kind else "") + "List"
        group_version = f"{resource.group}/{resource.version}" if resource.group else resource.version
        return {"apiVersion": group_version, "kind": kind,
                "metadata": {"resourceVersion": str(next(self._versions))}, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""
        bus = self._buses[request.resource]
        marker = await bus.mark()  # subscribe first: events during the snapshot are not lost
        try:
            async with self._lock:
                objs = self._KubernetesEmulator__get_objs(request, strict=False)
                events = [{"type": "ADDED", "object": o.raw} for o in objs if not o.deleted]
            for event in events:
                yield event
            async for event in bus.stream(since=marker):
                meta = event.get("object", {}).get("metadata", {})
                if self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"),
                                                   meta.get("name"), strict=False):
                    yield event
        finally:
            await bus.unmark(marker)

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            payload["groupVersion"] = request.resource.version
        return payload
