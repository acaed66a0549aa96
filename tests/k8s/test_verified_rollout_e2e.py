"""A rollout that changes greedy tokens is stopped, against the real control plane: the chart's
operator, the process kubelet's worker pods, the check over the pods' gRPC.

The engine option is a precision change (`--dtype=bfloat16` added to decode's engineArgs, the
model unchanged, so the check applies). The generated tiny model's top logits are too far apart
for bfloat16 to move any of them, as a real model's are not: its lm_head gets near-ties
(pdtest.checkpoint_utils.make_near_ties), which leave float32's tokens as they were and make
bfloat16 pick others. The offline engine, run in both dtypes on that checkpoint, says which
prompt and token differ first: the operator must name exactly that one. Then the spec is
fixed (float32 stated explicitly: harmless even here), and that new revision passes the check
and completes (before operator/status_patch.py it stayed stopped: the old revision's failure was
read back as the new one's).

Decode only (prefill and the router at 0 replicas: the check for decode pairs two decode groups,
and neither prefill nor a router pod would add anything but start-up time here); one group
rolled with surge (maxSurge 1, maxUnavailable 0), so an old group is there to compare with. The
harmless rollout that passes the check and completes is test_operator_e2e's new image tag."""
from __future__ import annotations

import asyncio
import pathlib
import random
import shutil
import time

import pytest
from e2e_deployment import CR_API, installed_release
from e2e_example import apply, example
from pdtest.checkpoint_utils import make_near_ties
from pdtest.waiting import wait_until

from deepseek_pd.operator import names
from deepseek_pd.operator.rollout_verify import MAX_NEW_TOKENS, PROMPTS, first_mismatch, greedy_outputs

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
RELEASE, OPS, NS = "verify", "ops-verify", "llm-verify"
NEW_ENGINE_ARG = "--dtype=bfloat16"


@pytest.fixture(scope="module")
def deployment(control_plane, admin_kube, process_kubelet, tmp_path_factory):
    with installed_release(control_plane, admin_kube, process_kubelet, tmp_path_factory.mktemp("verify-e2e"),
                           RELEASE, OPS, NS, "--set", "operator.resyncSeconds=2") as dep:
        yield dep


@pytest.fixture(scope="module")
def near_tie_models(models, tmp_path_factory) -> pathlib.Path:
    """The hostPath the example mounts at /models, its `tiny` with near-tie logits (a copy of the
    session's tiny checkpoint, which other modules' pods read unchanged)."""
    directory = tmp_path_factory.mktemp("near-tie-models")
    shutil.copytree(models / "tiny", directory / "tiny")
    make_near_ties(directory / "tiny", closeness=0.01, seed=random.randrange(2**31))
    return directory


def _oracle(model: pathlib.Path) -> dict[str, list[list[int]]]:
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


def _condition(cr: dict, kind: str) -> dict:
    return next((c for c in (cr.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def test_a_rollout_whose_engine_option_changes_greedy_tokens_is_stopped(deployment, near_tie_models):
    dep = deployment
    oracle = _oracle(near_tie_models / "tiny")
    expected = first_mismatch(oracle["float32"], oracle["bfloat16"])
    assert expected is not None, "the near-tie checkpoint gave bfloat16 the same tokens: no rollout to stop"
    obj = example(near_tie_models)
    obj["spec"]["prefill"]["replicas"] = 0
    obj["spec"]["router"] = {"replicas": 0}
    obj["spec"]["decode"].update(replicas=1, rolloutStrategy={"maxSurge": 1, "maxUnavailable": 0})
    started = time.monotonic()
    apply(dep, obj)
    cr_path = f"{CR_API}/namespaces/{NS}/deepseekdeployments/{dep.name}"
    wait_until(lambda: ((dep.cr() or {}).get("status") or {}).get("decode", {}).get("readyReplicas") == 1, 300,
               "decode group 0 not Ready", dep.diagnose)
    first_ready = time.monotonic() - started
    old_group = f"deepseek-pd.io/deployment={dep.name},deepseek-pd.io/role=decode,deepseek-pd.io/group-index=0"
    [old_pod] = dep.pods(old_group)

    dep.kube.merge_patch(cr_path, {"spec": {"decode": {"engineArgs": [*obj["spec"]["decode"]["engineArgs"],
                                                                      NEW_ENGINE_ARG]}}})
    cr = wait_until(lambda: (c := dep.cr()) and _condition(c, "RolloutVerified").get("reason") == "TokensDiffer" and c,
                    300, "the rollout was not stopped with TokensDiffer", dep.diagnose)
    print(f"decode group 0 Ready after {first_ready:.0f} s; the new group checked and refused "
          f"{time.monotonic() - started - first_ready:.0f} s after the patch")
    # The condition names the prompt and the first differing token, as the offline engine does.
    verified = _condition(cr, "RolloutVerified")
    assert verified["status"] == "False", verified
    assert f"decode group 1 (revision {cr['status']['decode']['revision']}) differs from group 0: {expected}" \
        in verified["message"], (verified, expected)
    assert cr["status"]["rollout"]["decode"]["failed"] in verified["message"], cr["status"]["rollout"]

    def events() -> list[dict]:
        return dep.kube.list(f"/api/v1/namespaces/{NS}/events", fieldSelector=f"involvedObject.name={dep.name}")
    # The handler posts the pass's Events after writing its status.
    wait_until(lambda: any(e.get("reason") == "TokensDiffer" for e in events()), 30, "no TokensDiffer Event")
    [differ] = [e for e in events() if e.get("reason") == "TokensDiffer"]
    assert differ["type"] == "Warning" and str(expected) in differ["message"], differ

    # Halted: over several resyncs (2 s) group 0 is neither replaced nor restarted, the router
    # (Static discovery) still names only it, and it answers with float32's tokens.
    time.sleep(8)
    [still] = dep.pods(old_group)
    assert still["metadata"]["uid"] == old_pod["metadata"]["uid"], "the old group was replaced"
    assert all(c["ready"] and c["restartCount"] == old["restartCount"] for c, old in zip(
        still["status"]["containerStatuses"], old_pod["status"]["containerStatuses"])), still["status"]
    router = dep.kube.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{names.router_name(dep.name)}")
    args = " ".join(router["spec"]["template"]["spec"]["containers"][0]["args"])
    assert names.leader_address(dep.name, "decode", 0, NS) in args, args
    assert names.leader_address(dep.name, "decode", 1, NS) not in args, args
    cr = dep.cr()
    assert 1 not in cr["status"]["rollout"]["decode"].get("verified", []), cr["status"]
    assert _condition(cr, "RolloutVerified")["reason"] == "TokensDiffer", cr["status"]
    address = f"{still['status']['podIP']}:{cr['spec']['decode']['port']}"
    assert asyncio.run(greedy_outputs(address)) == oracle["float32"]
    reasons = [e.get("reason") for e in events()]
    assert reasons.count("TokensDiffer") == 1 and "GroupVerified" not in reasons, reasons  # once, never passed

    # Fixed: the precision stated as it was (float32, harmless even on this sensitive model) is a
    # new revision, so a new check: its group answers as group 0, is verified, and the rollout
    # completes (group 0 retired, the bfloat16 group replaced).
    dep.kube.merge_patch(cr_path, {"spec": {"decode": {"engineArgs": [*obj["spec"]["decode"]["engineArgs"],
                                                                      "--dtype=float32"]}}})
    fixed = time.monotonic()

    def completed() -> dict | None:
        cr = dep.cr() or {}
        status = cr.get("status") or {}
        pods = [p for p in dep.pods(f"deepseek-pd.io/deployment={dep.name},deepseek-pd.io/role=decode")
                if not p["metadata"].get("deletionTimestamp")]
        done = status.get("observedGeneration") == cr["metadata"]["generation"] and len(pods) == 1 \
            and pods[0]["metadata"]["labels"][names.LABEL_REVISION] == status["decode"]["revision"] \
            and status["decode"].get("updatedReplicas") == 1 and status["decode"].get("readyReplicas") == 1
        return cr if done else None
    cr = wait_until(completed, 300, "the fixed rollout did not complete", dep.diagnose)
    print(f"the fixed revision verified and rolled out {time.monotonic() - fixed:.0f} s after the patch")
    wait_until(lambda: "GroupVerified" in [e.get("reason") for e in events()], 30, "no GroupVerified Event")
    [passed] = [e for e in events() if e.get("reason") == "GroupVerified"]
    assert f"(revision {cr['status']['decode']['revision']})" in passed["message"], passed
    assert _condition(cr, "RolloutVerified")["status"] == "True", cr["status"]
    [new_pod] = [p for p in dep.pods(f"deepseek-pd.io/deployment={dep.name},deepseek-pd.io/role=decode")
                 if not p["metadata"].get("deletionTimestamp")]  # not the retiring surge group's
    address = f"{new_pod['status']['podIP']}:{cr['spec']['decode']['port']}"
    assert asyncio.run(greedy_outputs(address)) == oracle["float32"]
