"""A rollout that changes greedy tokens is stopped, against the real control plane: the chart's
operator, the process kubelet's worker pods, the check over the pods' gRPC. Both roles roll at
once, each to an engine option that changes its tokens:

- decode, a precision change (`--dtype=bfloat16`, the model unchanged, so the check applies). The
  generated tiny model's top logits are too far apart for bfloat16 to move any of them, as a
  real model's are not: its lm_head gets near-ties (pdtest.checkpoint_utils.make_near_ties),
  which leave float32's tokens as they were and make bfloat16 pick others. The offline engine,
  run in both dtypes, says which prompt and token differ first.
- prefill, a quantisation change that keeps the KV layout (a dtype change would not: decode
  refuses a peer whose KV dtype differs, CheckFailed, never TokensDiffer): the checkpoint is
  FP8, the old revision dequantises it at load (CPU's `fp8_backend` auto), the new one keeps it
  in FP8 and quantises activations per token group (`--engine-opt=fp8_backend=torch`). The check
  pairs both prefill groups with the old decode group, so the oracle is a PD pair in this
  process (pdtest.pd_engine_harness.PDPair): prefill in each backend, decode dequantised.

The operator must name exactly the first difference of each. Then decode is fixed forward
(float32 stated explicitly: harmless even here), and that new revision passes the check and
completes (before operator/status_patch.py it stayed stopped: the old revision's failure was read
back as the new one's); prefill is rolled back (its engineArgs as before), which checks nothing:
group 0 stays routed and the refused group is retired (tests/operator/test_rollout_rollback.py).

One group per role, rolled with surge (maxSurge 1, maxUnavailable 0), so an old group is there
to compare with; the router at 0 replicas (the checks go to the pods' IPs, and a router pod would
add only start-up time). The harmless rollout through the router is test_operator_e2e's new
image tag."""
from __future__ import annotations

import asyncio
import pathlib
import random
import time
from dataclasses import dataclass

import pytest
from e2e_deployment import CR_API, installed_release
from e2e_example import apply, example
from pdtest.checkpoint_utils import make_near_ties
from pdtest.waiting import wait_until

from deepseek_pd.operator import names
from deepseek_pd.operator.rollout_verify import (MAX_NEW_TOKENS, PROMPTS, PrefillGroup, first_mismatch,
                                                 greedy_outputs, pd_greedy_outputs)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
RELEASE, OPS, NS = "verify", "ops-verify", "llm-verify"
ROLES = ("decode", "prefill")
# The engine option that changes each role's greedy tokens, and decode's old precision stated.
CHANGES = {"decode": "--dtype=bfloat16", "prefill": "--engine-opt=fp8_backend=torch"}
DECODE_FIXED = "--dtype=float32"
RESYNC_S = 1  # the operator's resync: a halted rollout is watched over several of its passes


@pytest.fixture(scope="module")
def deployment(control_plane, admin_kube, process_kubelet, tmp_path_factory):
    with installed_release(control_plane, admin_kube, process_kubelet, tmp_path_factory.mktemp("verify-e2e"),
                           RELEASE, OPS, NS, "--set", f"operator.resyncSeconds={RESYNC_S}") as dep:
        yield dep


@dataclass(frozen=True)
class Sensitive:
    """The hostPath the example mounts at /models, and PROMPTS' greedy tokens on its `tiny`."""

    models: pathlib.Path
    decode: dict[str, list[list[int]]]   # the offline engine, per dtype
    prefill: dict[str, list[list[int]]]  # a PD pair, per prefill fp8_backend (decode dequantised)


@pytest.fixture(scope="module")
def sensitive(tmp_path_factory) -> Sensitive:
    """An FP8 tiny checkpoint (the seeded RNG's weights) with near-tie logits, on which both roles'
    changes alter PROMPTS' tokens. A draw whose FP8 activations happen to leave every prefill
    answer as it was (about 1 in 16) is replaced by the next draw."""
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    rng = random.Random()
    for _ in range(6):
        directory = tmp_path_factory.mktemp("sensitive-models")
        make_tiny_model(directory / "tiny", fp8_block=(128, 128), seed=rng.randrange(2**31))
        make_near_ties(directory / "tiny", closeness=0.01, seed=rng.randrange(2**31))
        found = Sensitive(directory, _offline_oracle(directory / "tiny"), _pd_oracle(directory / "tiny"))
        if all(first_mismatch(*outputs.values()) for outputs in (found.decode, found.prefill)):
            # The PD pair with both sides dequantised is the offline engine in float32.
            assert found.prefill["dequant"] == found.decode["float32"], found
            return found
    pytest.fail("six FP8 near-tie checkpoints in a row gave no token a change would alter")


def _offline_oracle(model: pathlib.Path) -> dict[str, list[list[int]]]:
    """PROMPTS' greedy tokens from the offline engine in each dtype, with the pods' engine flags."""
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.workers.engine.offline import Engine
    from pdtest.e2e_cluster import CHUNKED_PREFILL_SIZE, PAGE_SIZE

    out = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(model=str(model), dtype=dtype, page_size=PAGE_SIZE, chunked_prefill_size=CHUNKED_PREFILL_SIZE)
        out[dtype] = [engine.generate(list(p), SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)).output_ids
                      for p in PROMPTS]
    return out


def _pd_oracle(model: pathlib.Path) -> dict[str, list[list[int]]]:
    """PROMPTS' greedy tokens through a prefill engine in each fp8_backend and a dequantising decode
    engine, one request at a time, as the operator's prefill check sends them (PROMPTS are
    shorter than a chunk, so the harness's chunk size does not matter)."""
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.sampling.params import SamplingParams
    from pdtest.e2e_cluster import PAGE_SIZE
    from pdtest.pd_engine_harness import PDPair

    def runner(fp8_backend: str) -> ModelRunner:
        return ModelRunner(RunnerConfig(model=str(model), page_size=PAGE_SIZE, num_pages=64, fp8_backend=fp8_backend))

    async def outputs(fp8_backend: str) -> list[list[int]]:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
        async with PDPair("fake", runners=(runner(fp8_backend), runner("dequant"))) as pair:
            answers = [await pair.run(p, greedy, f"oracle-{i}") for i, p in enumerate(PROMPTS)]
        assert all(prefill.ok and decode.ok for prefill, decode in answers), answers
        return [decode.tokens for _, decode in answers]
    return {backend: asyncio.run(outputs(backend)) for backend in ("dequant", "torch")}


def _condition(cr: dict, kind: str) -> dict:
    return next((c for c in (cr.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def _events(dep) -> list[dict]:
    return dep.kube.list(f"/api/v1/namespaces/{NS}/events", fieldSelector=f"involvedObject.name={dep.name}")


def _group(dep, role: str, index: int) -> str:
    return f"deepseek-pd.io/deployment={dep.name},deepseek-pd.io/role={role},deepseek-pd.io/group-index={index}"


def _live_pods(dep, role: str) -> list[dict]:
    return [p for p in dep.pods(f"deepseek-pd.io/deployment={dep.name},deepseek-pd.io/role={role}")
            if not p["metadata"].get("deletionTimestamp")]


def _role_outputs(cr: dict, decode: dict, prefill: dict | None = None) -> list[list[int]]:
    """PROMPTS through the decode pod `decode` alone, or through `prefill` then `decode` (PD)."""
    decode_address = f"{decode['status']['podIP']}:{cr['spec']['decode']['port']}"
    if prefill is None:
        return asyncio.run(greedy_outputs(decode_address))
    ip = prefill["status"]["podIP"]
    group = PrefillGroup(f"{ip}:{cr['spec']['prefill']['port']}", ip, cr["spec"]["prefill"]["bootstrapPort"])
    return asyncio.run(pd_greedy_outputs(group, decode_address))


def test_a_rollout_whose_engine_option_changes_greedy_tokens_is_stopped(deployment, sensitive, real_scheduler):
    dep = deployment
    expected = {"decode": first_mismatch(sensitive.decode["float32"], sensitive.decode["bfloat16"]),
                "prefill": first_mismatch(sensitive.prefill["dequant"], sensitive.prefill["torch"])}
    obj = example(sensitive.models)
    obj["spec"]["router"] = {"replicas": 0}
    obj["spec"]["scheduling"] = {"schedulerName": real_scheduler}  # the worker pods are the real kube-scheduler's
    for role in ROLES:
        obj["spec"][role].update(replicas=1, rolloutStrategy={"maxSurge": 1, "maxUnavailable": 0})
    started = time.monotonic()
    apply(dep, obj)
    cr_path = f"{CR_API}/namespaces/{NS}/deepseekdeployments/{dep.name}"
    wait_until(lambda: all(((dep.cr() or {}).get("status") or {}).get(role, {}).get("readyReplicas") == 1
                           for role in ROLES), 300, "group 0 of each role not Ready", dep.diagnose)
    first_ready = time.monotonic() - started
    old_pods = {role: dep.pods(_group(dep, role, 0))[0] for role in ROLES}

    dep.kube.merge_patch(cr_path, {"spec": {role: {"engineArgs": [*obj["spec"][role]["engineArgs"], CHANGES[role]]}
                                            for role in ROLES}})

    def both_stopped() -> dict | None:
        cr = dep.cr() or {}
        rollout = (cr.get("status") or {}).get("rollout") or {}
        stopped = all((rollout.get(role) or {}).get("failed") for role in ROLES)
        return cr if stopped and _condition(cr, "RolloutVerified").get("reason") == "TokensDiffer" else None
    cr = wait_until(both_stopped, 300, "the rollout was not stopped with TokensDiffer on both roles", dep.diagnose)
    print(f"group 0 of each role Ready after {first_ready:.0f} s; the new groups checked and refused "
          f"{time.monotonic() - started - first_ready:.0f} s after the patch")
    # Each role's failure names the prompt and the first differing token, as its oracle does; the
    # condition carries one of them (the worst role's, both equally bad here).
    verified = _condition(cr, "RolloutVerified")
    assert verified["status"] == "False", verified
    failed = {role: cr["status"]["rollout"][role]["failed"] for role in ROLES}
    for role in ROLES:
        assert f"{role} group 1 (revision {cr['status'][role]['revision']}) differs from group 0: {expected[role]}" \
            in failed[role], (role, failed[role], expected[role])
    assert verified["message"] in failed.values(), (verified, failed)

    # The handler posts the pass's Events after writing its status: one TokensDiffer per role.
    wait_until(lambda: sum(e.get("reason") == "TokensDiffer" for e in _events(dep)) == 2, 30,
               "no TokensDiffer Event for each role", lambda: str([e.get("message") for e in _events(dep)]))
    differ = [e for e in _events(dep) if e.get("reason") == "TokensDiffer"]
    for role in ROLES:
        assert [e for e in differ if e["type"] == "Warning" and str(expected[role]) in e["message"]], (role, differ)

    # Halted: over several resyncs neither group 0 is replaced nor restarted, the router
    # (Static discovery) still names only decode's group 0, and the old groups answer with the
    # old revision's tokens (prefill's through decode's).
    time.sleep(4 * RESYNC_S)
    still = {role: dep.pods(_group(dep, role, 0)) for role in ROLES}
    for role, old_pod in old_pods.items():
        [pod] = still[role]
        assert pod["metadata"]["uid"] == old_pod["metadata"]["uid"], f"the old {role} group was replaced"
        assert all(c["ready"] and c["restartCount"] == old["restartCount"] for c, old in zip(
            pod["status"]["containerStatuses"], old_pod["status"]["containerStatuses"])), pod["status"]
    router = dep.kube.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{names.router_name(dep.name)}")
    args = " ".join(router["spec"]["template"]["spec"]["containers"][0]["args"])
    for role in ROLES:
        assert names.leader_address(dep.name, role, 0, NS) in args, args
        assert names.leader_address(dep.name, role, 1, NS) not in args, args
    cr = dep.cr()
    for role in ROLES:
        assert 1 not in cr["status"]["rollout"][role].get("verified", []), cr["status"]
    assert _condition(cr, "RolloutVerified")["reason"] == "TokensDiffer", cr["status"]
    assert _role_outputs(cr, still["decode"][0]) == sensitive.decode["float32"]
    assert _role_outputs(cr, still["decode"][0], still["prefill"][0]) == sensitive.prefill["dequant"]
    reasons = [e.get("reason") for e in _events(dep)]
    assert reasons.count("TokensDiffer") == 2 and "GroupVerified" not in reasons, reasons  # once each, never passed

    # Decode fixed forward: float32 stated explicitly (harmless even on this sensitive model) is a
    # new revision, so a new check: its group answers as group 0, is verified, and the rollout
    # completes (group 0 retired, the refused group replaced). Prefill rolled back: the spec as
    # group 0 runs it, which serves on, unchecked and routed all along, while the refused group is
    # retired (before operator commit 7478ac8, group 0 was checked against the refused group,
    # "differed" and left the router).
    dep.kube.merge_patch(cr_path, {"spec": {
        "decode": {"engineArgs": [*obj["spec"]["decode"]["engineArgs"], DECODE_FIXED]},
        "prefill": {"engineArgs": obj["spec"]["prefill"]["engineArgs"]}}})
    fixed = time.monotonic()
    prefill_0 = names.leader_address(dep.name, "prefill", 0, NS)

    def completed() -> dict | None:
        router = dep.kube.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{names.router_name(dep.name)}")
        assert prefill_0 in " ".join(router["spec"]["template"]["spec"]["containers"][0]["args"]), router["spec"]
        cr = dep.cr() or {}
        status = cr.get("status") or {}
        done = status.get("observedGeneration") == cr["metadata"]["generation"] and all(
            len(pods := _live_pods(dep, role)) == 1
            and pods[0]["metadata"]["labels"][names.LABEL_REVISION] == status[role]["revision"]
            and status[role].get("updatedReplicas") == 1 and status[role].get("readyReplicas") == 1
            for role in ROLES)
        return cr if done else None
    cr = wait_until(completed, 300, "the fixed rollout did not complete", dep.diagnose)
    print(f"decode's fixed revision verified and rolled out, prefill's refused group retired, "
          f"{time.monotonic() - fixed:.0f} s after the patch")
    wait_until(lambda: "GroupVerified" in [e.get("reason") for e in _events(dep)], 30, "no GroupVerified Event")
    [passed] = [e["message"] for e in _events(dep) if e.get("reason") == "GroupVerified"]
    assert passed.startswith("decode group ") and f"(revision {cr['status']['decode']['revision']})" in passed, passed
    assert [e.get("reason") for e in _events(dep)].count("TokensDiffer") == 2  # the rollback refused nothing
    assert _condition(cr, "RolloutVerified")["status"] == "True", cr["status"]
    new = {role: _live_pods(dep, role)[0] for role in ROLES}  # not the retiring surge groups'
    assert new["prefill"]["metadata"]["uid"] == old_pods["prefill"]["metadata"]["uid"], "prefill group 0 was replaced"
    assert _role_outputs(cr, new["decode"]) == sensitive.decode["float32"]
    assert _role_outputs(cr, new["decode"], new["prefill"]) == sensitive.prefill["dequant"]
    for pod in [*old_pods.values(), *new.values()]:
        assert pod["spec"]["schedulerName"] == real_scheduler and pod["spec"]["nodeName"], pod["spec"]
