"""Applies the planner's decisions and the desired child manifests through `KubeClient`.

Every child is adopted by the DeepSeekDeployment (owner reference, so the garbage collector
removes it with its owner) and carries a hash of the manifest it was built from: a child is
patched only when that hash changes, so a steady state issues no writes at all.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
from typing import Any

import kopf

from deepseek_pd.operator import names
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.kube import ApiError, KubeClient
from deepseek_pd.operator.planner import (
    Action, CreateGroup, DeleteGroup, ReplaceGroup, RestartGroup,
)
from deepseek_pd.operator.spec import DeploymentSpec

Manifest = dict[str, Any]
Key = tuple[str, str]  # (kind, name)


def manifest_hash(manifest: Manifest) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


class Executor:
    """`observed` maps (kind, name) to the objects listed at the start of this reconcile pass."""

    def __init__(self, client: KubeClient, owner: dict[str, Any], spec: DeploymentSpec,
                 observed: dict[Key, Manifest], logger: logging.Logger | logging.LoggerAdapter) -> None:
        self._client = client
        self._owner = owner
        self._spec = spec
        self._observed = observed
        self._logger = logger

    async def apply(self, manifest: Manifest) -> None:
        """Create the child, or patch it when its manifest changed since it was applied."""
        desired = copy.deepcopy(manifest)
        meta = desired["metadata"]
        digest = manifest_hash(manifest)
        meta.setdefault("annotations", {})[names.ANNOTATION_APPLIED_HASH] = digest
        kopf.adopt(desired, owner=self._owner)
        key = (desired["kind"], meta["name"])
        current = self._observed.get(key)
        if current is None:
            try:
                await self._client.create(desired)
                self._logger.info("created %s %s", *key)
                return
            except ApiError as exc:
                if exc.status != 409:
                    raise
                current = {}  # created concurrently (or by a previous pass we did not see): patch it
        annotations = current.get("metadata", {}).get("annotations", {}) or {}
        applied = annotations.get(names.ANNOTATION_APPLIED_HASH)
        if applied != digest:
            await self._client.patch(key[0], self._spec.namespace, key[1], desired)
            self._logger.info("updated %s %s", *key)

    async def delete(self, kind: str, name: str) -> None:
        if await self._client.delete(kind, self._spec.namespace, name):
            self._logger.info("deleted %s %s", kind, name)

    async def _delete_pods(self, role: str, index: int) -> None:
        selector = names.group_selector(self._spec.name, role, index)
        for (kind, name), obj in self._observed.items():
            labels = obj.get("metadata", {}).get("labels", {}) or {}
            if kind == "Pod" and all(labels.get(k) == v for k, v in selector.items()):
                await self.delete("Pod", name)

    async def run(self, action: Action) -> None:
        group = names.group_name(self._spec.name, action.role, action.index)
        if isinstance(action, CreateGroup):  # its Service is among the desired static children
            await self._create_statefulset(action.role, action.index)
        elif isinstance(action, ReplaceGroup):
            self._logger.info("replacing %s: %s", group, action.reason)
            await self.delete("StatefulSet", group)
            await self._delete_pods(action.role, action.index)
            await self._create_statefulset(action.role, action.index)
        elif isinstance(action, RestartGroup):
            self._logger.warning("restarting every pod of %s: %s", group, action.reason)
            await self._delete_pods(action.role, action.index)
        elif isinstance(action, DeleteGroup):
            await self.delete("StatefulSet", group)
            await self._delete_pods(action.role, action.index)
            await self.delete("Service", group)

    async def _create_statefulset(self, role: str, index: int) -> None:
        manifest = build_group_statefulset(self._spec, role, index)
        kopf.adopt(manifest, owner=self._owner)
        try:
            await self._client.create(manifest)
            self._logger.info("created StatefulSet %s", manifest["metadata"]["name"])
        except ApiError as exc:
            if exc.status != 409:  # still terminating: the next pass creates it
                raise
