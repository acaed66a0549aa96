"""The DeepSeekRoleScale sync rule (operator/role_scale.py) on random histories of writes.

Oracle: the last writer wins. Between two operator passes either the deployment's
spec.<role>.replicas is edited (by a user or the operator's autoscaler), or the DeepSeekRoleScale's
spec.replicas is (by an HPA or `kubectl scale`), or neither; after the pass both hold the value of
the latest write (one that changed a value), and the status says so.
"""
from __future__ import annotations

import random

from deepseek_pd.operator import names
from deepseek_pd.operator.role_scale import build_role_scale, build_role_scale_crd, role_scale_status, sync_step


def _apply_pass(scale: dict, deployment: int, existing: int) -> tuple[dict, int]:
    """What sync_role_scales writes, on plain dicts."""
    step = sync_step(scale, deployment)
    if step.pull is not None:
        scale = {**scale, "spec": {**scale["spec"], "replicas": step.pull}}
    if step.push is not None:
        deployment = step.push
    return {**scale, "status": role_scale_status(step, existing, "v3", "prefill")}, deployment


def test_the_last_write_wins_on_random_histories(rng=random.Random()):
    for _ in range(200):
        deployment = rng.randint(0, 5)
        scale = build_role_scale("v3", "llm", "prefill", deployment)
        scale, deployment = _apply_pass(scale, deployment, deployment)
        for _ in range(rng.randint(1, 12)):
            writer = rng.choice(("deployment", "scale", "both-scale-last", "none"))
            value = rng.randint(0, 5)
            latest = deployment
            if writer in ("deployment", "both-scale-last"):
                deployment = latest = rng.randint(0, 5)
            # Writing the value the object already holds is no write (the server keeps the same
            # generation): it cannot win over the deployment's edit.
            if writer in ("scale", "both-scale-last") and value != scale["spec"]["replicas"]:
                scale = {**scale, "spec": {**scale["spec"], "replicas": value}}
                latest = value
            scale, deployment = _apply_pass(scale, deployment, rng.randint(0, 5))
            assert deployment == scale["spec"]["replicas"] == scale["status"]["syncedReplicas"] == latest, writer
            again = sync_step(scale, deployment)  # a steady pass writes nothing
            assert again.push is None and again.pull is None


def test_a_new_scale_starts_from_the_deployment_and_selects_the_role(rng=random.Random()):
    replicas = rng.randint(0, 9)
    scale = build_role_scale("v3", "llm", "decode", replicas)
    assert scale["metadata"]["name"] == "v3-decode" and scale["spec"]["replicas"] == replicas
    step = sync_step(scale, replicas)
    assert (step.push, step.pull, step.synced) == (None, None, replicas)
    status = role_scale_status(step, replicas + 1, "v3", "decode")
    assert status["selector"] == f"{names.LABEL_DEPLOYMENT}=v3,{names.LABEL_ROLE}=decode"
    assert status["replicas"] == replicas + 1  # groups that exist (a surge group counts)


def test_the_crd_serves_the_scale_subresource_at_the_synced_fields():
    version = build_role_scale_crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status) == set(role_scale_status(sync_step({"spec": {"replicas": 1}}, 1), 1, "a", "prefill"))


def test_a_pass_without_the_crd_or_the_rbac_goes_on_without_role_scales():
    """An older cluster (no DeepSeekRoleScale CRD: 404) or chart (no RBAC for it: 403): the pass
    still converges the deployment and reports its normal status, not an ApplyFailed."""
    import asyncio
    import logging

    from memory_api import MemoryApi
    from test_operator_reconcile import _body

    from deepseek_pd.operator.kube import ApiError
    from deepseek_pd.operator.reconcile import Reconciler

    for status in (403, 404):
        class Refusing(MemoryApi):
            async def get(self, kind, namespace, name):
                if kind == names.SCALE_KIND and status == 403:
                    raise ApiError(403, "Forbidden", "cannot get deepseekrolescales")
                return await super().get(kind, namespace, name)

            async def create(self, manifest):
                if manifest["kind"] == names.SCALE_KIND:
                    raise ApiError(status, "NotFound", "the server could not find the requested resource")
                return await super().create(manifest)

        api = Refusing()
        result = asyncio.run(Reconciler(api).reconcile(_body(), logging.getLogger("test")))
        degraded = next(c for c in result["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] != "ApplyFailed", degraded
        assert any(k == "StatefulSet" for k, _ in api.objects)
