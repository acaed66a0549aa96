"""One reconcile pass: parse the spec, observe the children, plan per role, execute, report status.

Everything decided here comes from the pure modules (spec, builders, planner, status); this file
only sequences them around the I/O. A pass is idempotent, so handlers and the resync timer may
call it as often as they like.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.autoscale_reconcile import Autoscaler
from deepseek_pd.operator.build_model import build_model_cache_claim
from deepseek_pd.operator.build_network_policy import build_network_policy
from deepseek_pd.operator.build_metrics import build_service_monitor
from deepseek_pd.operator.build_router import build_router_children, router_endpoint
from deepseek_pd.operator.build_workers import build_group_service, build_worker_configmap
from deepseek_pd.operator.executor import Executor, Key, Manifest, manifest_hash
from deepseek_pd.operator.gang_status import CONDITION as GANG_CONDITION, gang_state
from deepseek_pd.operator.kube import ApiError, KubeClient
from deepseek_pd.operator.kv_ports_status import mooncake_ports_condition
from deepseek_pd.operator.engine_args import engine_args_violations
from deepseek_pd.operator.memory_plan import MemoryVerdict, plan_memory
from deepseek_pd.operator.model_status import model_state
from deepseek_pd.operator.observed import groups_of_role
from deepseek_pd.operator.planner import DeleteGroup, RolePlan, RoleTarget, plan_role
from deepseek_pd.operator.pod_placement import build_pod_group, pod_groups_named, topology_dropped
from deepseek_pd.operator.pod_scheduling import explain_unavailable
from deepseek_pd.operator.rollout_reconcile import CONDITION as VERIFY_CONDITION
from deepseek_pd.operator.rollout_reconcile import RolloutVerifier, combined_condition
from deepseek_pd.operator.role_scale_reconcile import sync_role_scales
from deepseek_pd.operator.router_discovery import WORKER_DISCOVERY, RouterGroups, worker_url
from deepseek_pd.operator.router_rollout import (
    groups_still_named, is_router_pod, rollout_gave_up, router_rolled_out,
)
from deepseek_pd.operator.secret_reconcile import (
    check_user_secrets, delete_generated_secrets, ensure_generated_secrets, secrets_condition,
)
from deepseek_pd.operator.spec import DeploymentSpec, InvalidSpecError
from deepseek_pd.operator.status import (
    RouterState, condition, build_apply_error_status, build_invalid_status, build_memory_refused_status, build_status,
)
from deepseek_pd.operator.worker_security import build_prefill_peers_service

# Every kind the operator creates and lists, in the order it cleans them up (pods last: owners go
# first). Secrets are not listed (that would read every Secret of the namespace): secret_reconcile
# gets and deletes them by name.
OWNED_KINDS = ("Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "RoleBinding",
               "Role", "ServiceAccount", "ServiceMonitor", "PodGroup", "Pod", "PersistentVolumeClaim")
# Kinds whose children are fully described by build_static_children (+ group Services).
STATIC_KINDS = ("ConfigMap", "Service", "ServiceAccount", "Role", "RoleBinding", "Deployment",
                "NetworkPolicy", "PersistentVolumeClaim", "ServiceMonitor", "PodGroup")
# Kinds from CRDs a cluster may not have: listing them answers 404 there, which means "none".
OPTIONAL_KINDS = ("ServiceMonitor", "PodGroup")


def build_static_children(spec: DeploymentSpec, router_groups: RouterGroups | None = None) -> list[Manifest]:
    """Worker configs and the router. `router_groups`: the groups the router serves (default:
    every desired group); a reconcile pass passes the planner's `serving` groups."""
    claim = build_model_cache_claim(spec)
    return [
        *([claim] if claim else []),
        build_worker_configmap(spec, spec.prefill),
        build_worker_configmap(spec, spec.decode),
        build_prefill_peers_service(spec),
        *([build_network_policy(spec)] if spec.network_policy.enabled else []),
        *build_router_children(spec, router_groups),
        *filter(None, [build_service_monitor(spec)]),
    ]


def role_target(spec: DeploymentSpec, role: str) -> RoleTarget:
    role_spec = spec.role(role)
    surge, unavailable = role_spec.rollout.resolve(role_spec.replicas)
    return RoleTarget(role=role, replicas=role_spec.replicas, size=role_spec.size,
                      revision=spec.role_revision(role), max_surge=surge,
                      max_unavailable=unavailable,
                      recreate_group_on_restart=role_spec.recreate_group_on_restart)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    def __init__(self, client: KubeClient, autoscaler: Autoscaler | None = None,
                 verifier: RolloutVerifier | None = None) -> None:
        self._client = client
        self.unserved: set[str] = set()  # optional kinds the API server answered 404 for, last look
        self._autoscaler = autoscaler or Autoscaler(client)
        self._verifier = verifier or RolloutVerifier()

    async def observe(self, namespace: str, name: str) -> dict[Key, Manifest]:
        observed: dict[Key, Manifest] = {}
        for kind in OWNED_KINDS:
            try:
                objects = await self._client.list(kind, namespace, {names.LABEL_DEPLOYMENT: name})
            except ApiError as exc:
                if exc.status == 404 and kind in OPTIONAL_KINDS:
                    self.unserved.add(kind)
                    continue
                raise
            self.unserved.discard(kind)
            for obj in objects:
                observed[(kind, obj["metadata"]["name"])] = obj
        return observed

    async def reconcile(self, body: dict[str, Any],
                        logger: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:
        """Brings the children towards the spec; returns the status to write."""
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        generation = meta.get("generation")
        previous = dict(body.get("status") or {})
        try:
            # Not dict(): a spec that is not an object (from a server without the CRD's schema)
            # is the parser's "spec: ... is not of type 'object'", not a TypeError here.
            spec = DeploymentSpec.parse(name, namespace, body.get("spec"))
            if problems := engine_args_violations(spec):  # what its workers would refuse at start-up
                raise InvalidSpecError(problems)
        except InvalidSpecError as exc:
            logger.error("invalid spec, children left unchanged: %s", exc)
            return build_invalid_status(str(exc), generation, previous, _now())
        memory = plan_memory(spec)  # before anything is created: a plan that cannot fit creates nothing
        if memory.refused:
            logger.error("the memory plan does not fit, children left unchanged: %s", memory.message)
            return build_memory_refused_status(memory, generation, previous, _now())

        try:
            return await self._converge(body, spec, memory, generation, previous, logger)
        except ApiError as exc:
            if exc.status in (401, 409, 429) or exc.status >= 500:
                raise  # transient: kopf retries the handler with backoff
            logger.error("the API server refused a change: %s", exc)
            return build_apply_error_status(str(exc), generation, previous, _now())

    async def _converge(self, body: dict[str, Any], spec: DeploymentSpec, memory: MemoryVerdict,
                        generation: int | None, previous: dict[str, Any],
                        logger: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:
        name, namespace = spec.name, spec.namespace
        observed = await self.observe(namespace, name)
        # Secrets first: worker and router pods cannot start without them.
        secret_problems = await ensure_generated_secrets(self._client, body, spec, logger)
        secret_problems += await check_user_secrets(self._client, spec)
        executor = Executor(self._client, body, spec, observed, logger)
        statefulsets = [o for (k, _), o in observed.items() if k == "StatefulSet"]
        pods = [o for (k, _), o in observed.items() if k == "Pod"]
        plans: dict[str, RolePlan] = {}
        targets = {role: role_target(spec, role) for role in names.ROLES}
        checks = {role: await self._verifier.run(spec, role, targets[role].revision, statefulsets, pods, previous)
                  for role in names.ROLES}
        for role, checked in checks.items():
            targets[role] = dataclasses.replace(targets[role], unverified=checked.unverified,
                                                verification_failed=checked.failed)
        for role in names.ROLES:
            plans[role] = plan_role(targets[role], groups_of_role(role, statefulsets, pods))

        # The router lists the groups that will serve (Static); a static child no longer built,
        # such as its Role after a switch from Selector to Static, is deleted below.
        desired = build_static_children(spec, {role: sorted(p.serving) for role, p in plans.items()})
        held = self._held_deletions(spec, plans, desired, observed)
        gang = spec.scheduling.get("gang") and "PodGroup" not in self.unserved
        for role, plan in plans.items():
            indices = plan.group_indices | held[role]  # a held group stays reachable by name
            desired += [build_group_service(spec, role, i) for i in sorted(indices)]
            desired += [build_pod_group(spec, role, i) for i in sorted(indices)] if gang else []
        for manifest in desired:
            await executor.apply(manifest)
        for role, plan in plans.items():
            for action in plan.actions:
                if not (isinstance(action, DeleteGroup) and action.index in held[role]):
                    await executor.run(action)
        wanted = {(m["kind"], m["metadata"]["name"]) for m in desired}
        wanted |= {("PodGroup", n) for n in pod_groups_named(statefulsets)}  # an older revision's, until replaced
        for kind, child in sorted(observed):
            if kind in STATIC_KINDS and (kind, child) not in wanted:
                await executor.delete(kind, child)

        router_obj = observed.get(("Deployment", names.router_name(name)), {})
        router = RouterState(desired=spec.router.replicas,
                             ready=int((router_obj.get("status") or {}).get("readyReplicas") or 0),
                             endpoint=router_endpoint(spec))
        floors = {r: t.replicas - t.max_unavailable for r, t in targets.items()}
        revisions = {r: t.revision for r, t in targets.items()}
        model = model_state(pods, revisions)
        now = _now()
        status = build_status(plans, revisions, floors, router, generation, previous, now, model, memory)
        status["conditions"].append(secrets_condition(secret_problems, generation, previous, now))
        status["conditions"].append(mooncake_ports_condition(spec, generation, previous, now))
        rollout = {role: c.state for role, c in checks.items() if c.state is not None}
        if rollout or previous.get("rollout"):  # None (a role's, or the whole): a merge patch removes it
            status["rollout"] = {**{r: None for r in previous.get("rollout") or {}}, **rollout} if rollout else None
        verified = combined_condition(checks)
        if verified is not None:
            before = {c.get("type", ""): c for c in previous.get("conditions") or []}
            status["conditions"].append(condition(VERIFY_CONDITION, *verified, generation, before, now))
        pod_groups = [o for (k, _), o in observed.items() if k == "PodGroup"]
        state = gang_state(spec, "PodGroup" not in self.unserved, pods, revisions,
                           datetime.datetime.now(datetime.timezone.utc), topology_dropped(spec, pod_groups))
        if state is not None:
            before = {c.get("type", ""): c for c in previous.get("conditions") or []}
            status["conditions"].append(condition(GANG_CONDITION, *state, generation, before, now))
        for role in names.ROLES:  # the scale subresource's labelSelectorPath (an HPA counts these pods)
            status[role]["selector"] = names.selector_string({names.LABEL_DEPLOYMENT: name,
                                                              names.LABEL_ROLE: role})
        # Each role's DeepSeekRoleScale (its scale subresource) follows spec.<role>.replicas, or,
        # when an HPA or `kubectl scale` moved it, the deployment follows it (next pass acts).
        try:
            await sync_role_scales(self._client, body, spec, {r: status[r]["replicas"] for r in names.ROLES})
        except ApiError as exc:
            if exc.status != 403:
                raise
            # An operator image newer than its chart: the rest of the pass stands without them.
            logger.warning("no DeepSeekRoleScale (the operator may not use them: %s); upgrade the "
                           "chart for per-role scale subresources", exc)
        autoscaling = await self._autoscaler.run(body, spec, plans, pods, previous)
        if autoscaling or previous.get("autoscaling"):
            status["autoscaling"] = autoscaling or None  # None: a merge patch removes it
        return explain_unavailable(status, pods)

    @staticmethod
    def _held_deletions(spec: DeploymentSpec, plans: dict[str, RolePlan], desired: list[Manifest],
                        observed: dict[Key, Manifest]) -> dict[str, frozenset[int]]:
        """Retired groups a router that lists its groups may still send to: they are deleted
        only once the router rollout without them is complete (see router_rollout)."""
        name = names.router_name(spec.name)
        router = next(m for m in desired if m["kind"] == "Deployment" and m["metadata"]["name"] == name)
        deployment = observed.get(("Deployment", name))
        retiring = {role: frozenset(a.index for a in plan.actions if isinstance(a, DeleteGroup))
                    for role, plan in plans.items()}
        if not WORKER_DISCOVERY[spec.router.worker_discovery].lists_groups or rollout_gave_up(deployment):
            return {role: frozenset() for role in plans}
        if not router_rolled_out(deployment, manifest_hash(router)):
            return retiring
        router_pods = [o for (k, _), o in observed.items() if k == "Pod" and is_router_pod(o)]
        return {role: groups_still_named(router_pods, indices, functools.partial(worker_url, spec, role))
                for role, indices in retiring.items()}

    async def delete_children(self, namespace: str, name: str,
                              logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Explicit cleanup on CR deletion; owner references would do it too, but later."""
        for kind, child in (await self.observe(namespace, name)):
            if await self._client.delete(kind, namespace, child):
                logger.info("deleted %s %s", kind, child)
        for role in names.ROLES:  # by name, as the secrets: a missing CRD answers 404 (False)
            if await self._client.delete(names.SCALE_KIND, namespace, names.role_scale_name(name, role)):
                logger.info("deleted %s %s", names.SCALE_KIND, names.role_scale_name(name, role))
        await delete_generated_secrets(self._client, namespace, name, logger)
