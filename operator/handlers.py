"""The kopf wiring: thin handlers that call `Reconciler` and write `status` explicitly.

Kubernetes is edge-triggered; pods failing do not touch the DeepSeekDeployment, so besides the
create/update/resume handlers a timer re-runs the same idempotent pass every `resync_seconds`,
and a watch on DeepSeekRoleScale runs it when an HPA moves a role's /scale.
All of them serialise on a per-object lock, and they return None: kopf's per-handler result
storage (`status.<handler>`) is never used, so renaming a function cannot change the API.
kopf's own bookkeeping goes to annotations, leaving `status` to the documented fields.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import kopf

from deepseek_pd.operator import names
from deepseek_pd.operator.autoscale_reconcile import decision_events
from deepseek_pd.operator.kube import ApiError, KubeClient
from deepseek_pd.operator.readiness import Readiness, serve_readiness
from deepseek_pd.operator.reconcile import Reconciler
from deepseek_pd.operator.rollout_reconcile import rollout_events
from deepseek_pd.operator.status_patch import status_patch

LoginFn = Callable[..., kopf.ConnectionInfo | None]

# kopf keeps a deleted CR's finalizer until its resync timer has exited. A pass under way runs to
# its end, and kopf looks again only on the CR's next watch event or after this many seconds (its
# default, 60, kept a CR whose last pass wrote no status for a minute after its deletion).
TIMER_EXIT_POLL_SECONDS = 1.0


def default_login(*, settings: kopf.OperatorSettings, **kwargs: Any) -> kopf.ConnectionInfo:
    """In-cluster service account first, then ~/.kube/config (for running the operator locally)."""
    info = kopf.login_with_service_account(settings=settings, **kwargs) or \
        kopf.login_with_kubeconfig(settings=settings, **kwargs)
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig found")
    return info


@dataclass(frozen=True)
class OperatorConfig:
    """How the operator runs; built once by `deepseek-pd operator run` (or a test)."""

    resync_seconds: float = 10.0
    login: LoginFn = default_login


def scale_moved(body: kopf.Body, type: str | None = None, **_: Any) -> bool:
    """A DeepSeekRoleScale whose spec.replicas someone set since the operator's last pass."""
    if type == "DELETED":
        return False
    return body.get("spec", {}).get("replicas") != body.get("status", {}).get("syncedReplicas")


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    resource = (names.GROUP, names.VERSION, names.PLURAL)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return config.login(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = f"{names.GROUP}/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=names.GROUP, key="last-handled-configuration")
        settings.posting.level = logging.WARNING
        settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS
        memo.client = KubeClient(functools.partial(config.login, settings=settings,
                                                   logger=logging.getLogger(__name__)))
        memo.reconciler = Reconciler(memo.client)
        memo.locks = {}

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        await memo.client.close()

    async def run_pass(namespace: str, name: str, uid: str | None, memo: kopf.Memo,
                       logger: logging.Logger) -> None:
        """One pass over the DeepSeekDeployment `namespace/name` (of `uid`; None: whichever
        holds the name), and its status written before the next pass of the object may start.

        The body kopf hands a handler is the one of the event that woke it: a pass queued behind
        another (an update event from the autoscaler's own spec patch, the timer) would read the
        status from before that pass wrote it, and write back stale autoscaling history (its
        stabilisation windows, lastScale). So each pass reads the object afresh under the lock and
        writes its status itself, still under the lock; kopf's patch (written after the handler
        returns, i.e. after the lock is released) is not used for status."""
        if uid is None:
            found = await memo.client.get(names.KIND, namespace, name)
            if found is None:
                return
            uid = found["metadata"]["uid"]
        lock = memo.locks.setdefault(uid, asyncio.Lock())
        async with lock:
            fresh = await memo.client.get(names.KIND, namespace, name)
            if fresh is None or fresh.get("metadata", {}).get("uid") != uid:
                return  # deleted (or deleted and created again: that object's own events follow)
            if fresh["metadata"].get("deletionTimestamp"):
                return  # on_delete owns it now
            status = await memo.reconciler.reconcile(fresh, logger)
            current = dict(fresh.get("status") or {})
            changed = status_patch(current, status)  # {} in steady state: no churn
            if changed:
                try:
                    await memo.client.patch_status(names.KIND, namespace, name, {"status": changed})
                except ApiError as exc:
                    if exc.status != 404:  # deleted during the pass: nothing left to report on
                        raise
                    return
        for type_, reason, message in decision_events(current.get("autoscaling") or {},
                                                      status.get("autoscaling") or {}) + \
                rollout_events(current.get("rollout") or {}, status.get("rollout") or {}):
            kopf.event(fresh, type=type_, reason=reason, message=message)

    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, registry=registry)
    async def on_change(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        await run_pass(body.metadata.namespace, body.metadata.name, body.metadata.uid, memo, logger)

    @kopf.timer(*resource, interval=config.resync_seconds, registry=registry)
    async def resync(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        if body.metadata.deletion_timestamp is None:
            await run_pass(body.metadata.namespace, body.metadata.name, body.metadata.uid, memo, logger)

    # An HPA, KEDA or `kubectl scale` writing a role's DeepSeekRoleScale (its /scale) is acted on
    # at once, not at the next resync: a watch event (kopf.on.event stores nothing on the object)
    # whose spec.replicas differs from what the operator last carried over runs a pass of the
    # owning deployment (which pushes the value into spec.<role>.replicas: role_scale.py). The
    # operator's own writes (a pull: spec, then status) can show that difference for one event
    # between the two patches; the pass they run finds nothing to do.
    @kopf.on.event(names.GROUP, names.VERSION, names.SCALE_PLURAL, registry=registry, when=scale_moved)
    async def on_role_scale(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        owner = next((o for o in body.metadata.get("ownerReferences") or [] if o.get("kind") == names.KIND), None)
        if owner is not None:
            await run_pass(body.metadata.namespace, owner["name"], owner.get("uid"), memo, logger)

    @kopf.on.delete(*resource, registry=registry)
    async def on_delete(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        lock = memo.locks.setdefault(body.metadata.uid, asyncio.Lock())
        async with lock:
            await memo.reconciler.delete_children(body.metadata.namespace, body.metadata.name, logger)
        memo.locks.pop(body.metadata.uid, None)

    return registry


async def run_operator(config: OperatorConfig, *, namespaces: tuple[str, ...] = (),
                       stop_flag: Any = None, ready_flag: asyncio.Event | None = None,
                       liveness_endpoint: str | None = None, readiness_port: int = 0) -> None:
    """Runs until stop_flag is set (or forever). No namespaces means cluster-wide.
    `readiness_port`: serve /readyz there (operator/readiness.py); 0: off."""
    ready_flag = ready_flag if ready_flag is not None else asyncio.Event()
    client = KubeClient(functools.partial(config.login, settings=kopf.OperatorSettings(),
                                          logger=logging.getLogger(__name__)))
    runner = await serve_readiness(Readiness(ready_flag, client.served), "0.0.0.0", readiness_port) \
        if readiness_port else None
    try:
        await kopf.operator(
            registry=build_registry(config),
            standalone=True,  # one replica (Recreate strategy); no peering objects needed
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            liveness_endpoint=liveness_endpoint,
            memo=kopf.Memo(),
        )
    finally:
        if runner is not None:
            await runner.cleanup()
        await client.close()
