"""The autoscaler's I/O: scrape the SLO metrics of the pods the operator owns, ask the pure planner
(autoscaler.py), patch `spec.<role>.replicas`, and report every decision in the status.

Per reconcile pass, for each role with `autoscaling`:
    1. scrape /metrics of every rank of the role's Ready pods (pod IP, metrics.port + local rank;
       a rank that does not answer within SCRAPE_TIMEOUT_S does not vote)
    2. read the role's metrics against the previous pass's scrape (kept in memory, per pod UID
       and rank: a restart counts from zero, and an operator restart only costs one pass)
    3. decide (history of recommendations from status.autoscaling.<role>.recommendations, so the
       stabilisation windows survive an operator restart); hold while the role rolls out,
       each such pass a recommendation to keep its groups (autoscaler.hold_while_rolling)
    4. at most one role changes per pass; the change is a merge patch of spec.<role>.replicas,
       and the planner's group plan (planner.py) does the rest: the router drops a retired group
       before it is deleted, and its pods get SIGTERM, which drains the running requests

status.autoscaling.<role>: {lastDecision, lastScale (the last change), recommendations, lastScaleAt}.
The handler posts the Events `decision_events` names (Scaled; MetricsUnavailable).
"""
from __future__ import annotations

import asyncio
import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp

from deepseek_pd.operator import names
from deepseek_pd.operator.autoscale_metrics import RankSample, parse_sample, role_reading
from deepseek_pd.operator.autoscaler import (
    NO_METRICS, Decision, Recommendation, decide, hold_while_rolling, one_role_at_a_time,
)
from deepseek_pd.operator.build_metrics import ranks_per_pod
from deepseek_pd.operator.kube import KubeClient
from deepseek_pd.operator.planner import RolePlan
from deepseek_pd.operator.spec import DeploymentSpec

SCRAPE_TIMEOUT_S = 2.0
Fetch = Callable[[str], Awaitable[str]]


async def http_fetch(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as session:
        async with session.get(url) as resp:
            resp.raise_for_status()
            return await resp.text()


def _is_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Autoscaler:
    client: KubeClient
    fetch: Fetch = http_fetch
    clock: Callable[[], float] = time.time
    _samples: dict[tuple[str, str, str], dict[str, RankSample]] = field(default_factory=dict)

    async def _scrape(self, spec: DeploymentSpec, role: str, pods: list[dict]) -> dict[str, RankSample]:
        role_spec = spec.role(role)
        targets = []
        for pod in pods:
            labels = pod["metadata"].get("labels") or {}
            ip = (pod.get("status") or {}).get("podIP")
            if labels.get(names.LABEL_ROLE) != role or not ip or not _is_ready(pod):
                continue
            for rank in range(ranks_per_pod(role_spec)):
                key = f"{pod['metadata'].get('uid', pod['metadata']['name'])}/{rank}"
                targets.append((key, f"http://{ip}:{spec.metrics.port + rank}/metrics"))
        texts = await asyncio.gather(*(self.fetch(url) for _, url in targets), return_exceptions=True)
        return {key: parse_sample(text) for (key, _), text in zip(targets, texts) if isinstance(text, str)}

    async def run(self, body: dict[str, Any], spec: DeploymentSpec, plans: dict[str, RolePlan],
                  pods: list[dict], previous: dict[str, Any]) -> dict[str, Any]:
        """One pass; returns status.autoscaling (empty when no role autoscales)."""
        before = previous.get("autoscaling") or {}
        now = self.clock()
        decisions: dict[str, Decision] = {}
        for role in names.ROLES:
            auto = spec.role(role).autoscaling
            if auto is None:
                self._samples.pop((spec.namespace, spec.name, role), None)
                continue
            key = (spec.namespace, spec.name, role)
            scraped = await self._scrape(spec, role, pods)
            readings = role_reading(role, self._samples.get(key, {}), scraped, spec.role(role).replicas)
            self._samples[key] = scraped
            history = tuple(Recommendation(float(r["at"]), int(r["replicas"]))
                            for r in (before.get(role) or {}).get("recommendations") or [])
            current = spec.role(role).replicas
            if plans[role].rolling:
                decisions[role] = hold_while_rolling(role, auto, current, readings, history, now)
            else:
                decisions[role] = decide(role, auto, current, readings, history, now)
        last_scaled = {role: float((before.get(role) or {}).get("lastScaleAt", 0.0)) for role in names.ROLES}
        decisions = one_role_at_a_time(decisions, last_scaled)
        status: dict[str, Any] = {}
        for role, d in decisions.items():
            old = before.get(role) or {}
            if d.changed:
                await self.client.patch(names.KIND, spec.namespace, spec.name,
                                        {"spec": {role: {"replicas": d.replicas}}})
            decision = {"from": d.current, "to": d.replicas, "reason": d.reason,
                        # Unread metrics are left out: a null would be a deletion in a merge patch.
                        "readings": {k: round(v, 6) for k, v in d.readings.items() if v is not None}}
            same = {k: v for k, v in (old.get("lastDecision") or {}).items() if k != "time"} == decision
            last = {**decision, "time": old["lastDecision"]["time"] if same else _iso(now)}
            status[role] = {
                "lastDecision": last,
                "recommendations": [{"at": r.at, "replicas": r.replicas} for r in d.history],
                "lastScaleAt": now if d.changed else old.get("lastScaleAt", 0.0),
            }
            # A later hold overwrites lastDecision; why the groups last changed stays readable.
            if d.changed or old.get("lastScale"):
                status[role]["lastScale"] = last if d.changed else old["lastScale"]
        return status


def decision_events(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events to post, from status.autoscaling of the previous and
    of this pass: every change (Scaled), and a role whose metrics cannot be read any more
    (MetricsUnavailable, once); a steady hold posts nothing."""
    events = []
    for role, state in after.items():
        previous = (before or {}).get(role) or {}
        new, old = state["lastDecision"], previous.get("lastDecision") or {}
        readings = ", ".join(f"{k}={v}" for k, v in new["readings"].items())
        # This pass changed the groups: lastScaleAt moved (a float). Not the decision's time, which
        # has whole seconds: a change in the same second as the decision before it went unposted.
        if new["from"] != new["to"] and state.get("lastScaleAt") != previous.get("lastScaleAt"):
            events.append(("Normal", "Scaled", f"{role}: {new['reason']} (read: {readings})"))
        elif NO_METRICS in new["reason"] and NO_METRICS not in old.get("reason", ""):
            events.append(("Warning", "MetricsUnavailable", f"{role}: {new['reason']}"))
    return events
