"""An in-memory stand-in for the operator's KubeClient, for one reconcile pass without a cluster."""
from __future__ import annotations

import copy
from collections.abc import Callable

from deepseek_pd.operator.kube import ApiError


class MemoryApi:
    """Just enough of KubeClient: objects keyed by (kind, name); counts writes. `admit`, when
    given, checks each object as stored (raising ApiError refuses the write), as the API server's
    validation would."""

    def __init__(self, refuse_kind: str | None = None,
                 admit: Callable[[dict], None] | None = None) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.writes: list[tuple[str, str, str]] = []
        self.refuse_kind = refuse_kind
        self.admit = admit or (lambda obj: None)

    async def list(self, kind, namespace, labels):
        return [copy.deepcopy(o) for (k, _), o in self.objects.items() if k == kind
                and all(o["metadata"].get("labels", {}).get(a) == b for a, b in labels.items())]

    async def get(self, kind, namespace, name):
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def create(self, manifest):
        key = (manifest["kind"], manifest["metadata"]["name"])
        if manifest["kind"] == self.refuse_kind:
            raise ApiError(422, "Invalid", f"{manifest['kind']} refused by an admission webhook")
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", "exists")
        self.admit(manifest)
        self.objects[key] = copy.deepcopy(manifest)
        self.writes.append(("create", *key))
        return copy.deepcopy(manifest)

    async def patch(self, kind, namespace, name, patch):
        merged = {**self.objects[(kind, name)], **copy.deepcopy(patch)}
        self.admit(merged)
        self.objects[(kind, name)] = merged
        self.writes.append(("patch", kind, name))

    async def patch_status(self, kind, namespace, name, patch):
        await self.patch(kind, namespace, name, patch)

    async def delete(self, kind, namespace, name):
        self.writes.append(("delete", kind, name))
        return self.objects.pop((kind, name), None) is not None
