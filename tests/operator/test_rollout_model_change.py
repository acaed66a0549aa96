"""A rollout whose new groups serve another model (GetModelInfo's model_path differs: another
checkpoint or revision) is not token-checked: new weights may change tokens by design, so the new
group counts as verified without a check; with the same model on both sides the check runs and a
difference stops the rollout. RolloutVerifier.run on observed objects, the workers faked by their
answers (the check against real workers: test_rollout_verify.py)."""
from __future__ import annotations

import asyncio
import pathlib
import random

import yaml

from deepseek_pd.operator import names
from deepseek_pd.operator.rollout_reconcile import RolloutVerifier
from deepseek_pd.operator.rollout_verify import Mismatch
from deepseek_pd.operator.spec import DeploymentSpec

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _objects(role: str, revisions: dict[int, str], ips: dict[int, str]) -> tuple[list[dict], list[dict]]:
    """A ready one-pod group per index, with that revision, its leader at that IP."""
    statefulsets, pods = [], []
    for index, revision in revisions.items():
        labels = {names.LABEL_ROLE: role, names.LABEL_GROUP_INDEX: str(index)}
        statefulsets.append({"metadata": {"labels": labels, "annotations": {names.ANNOTATION_REVISION: revision}}})
        pods.append({"metadata": {"name": f"g{index}-0", "labels": {**labels, names.LABEL_POD_INDEX: "0",
                                                                   names.LABEL_REVISION: revision}},
                     "status": {"phase": "Running", "podIP": ips[index],
                                "conditions": [{"type": "Ready", "status": "True"}]}})
    return statefulsets, pods


def _verify(same_model: bool, seed: int):
    rng = random.Random(seed)
    spec = DeploymentSpec.parse("demo", "llm", yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())["spec"])
    ips = {0: f"10.0.0.{rng.randrange(1, 100)}", 1: f"10.0.1.{rng.randrange(1, 100)}"}
    port = spec.role("decode").port
    models = {f"{ips[0]}:{port}": "/models/a", f"{ips[1]}:{port}": "/models/a" if same_model else "/models/b"}
    checked = []

    async def check(new: str, old: str) -> Mismatch:
        checked.append((new, old))
        return Mismatch(prompt=0, position=rng.randrange(8), old=1, new=2)

    async def model_of(address: str) -> str:
        return models[address]

    statefulsets, pods = _objects("decode", {0: "old", 1: "new"}, ips)
    verifier = RolloutVerifier(check=check, model_of=model_of)
    result = asyncio.run(verifier.run(spec, "decode", "new", statefulsets, pods, {}))
    return result, checked, ips, port


def test_a_new_model_skips_the_token_check_and_the_same_model_is_checked():
    seed = random.randrange(1 << 30)  # the run seed's draw (pdtest/seeding.py)
    result, checked, _, _ = _verify(same_model=False, seed=seed)
    assert checked == [] and result.unverified == frozenset(), result
    assert result.condition[:2] == (True, "Verified") and result.state["verified"] == [1], result

    result, checked, ips, port = _verify(same_model=True, seed=seed)
    assert checked == [(f"{ips[1]}:{port}", f"{ips[0]}:{port}")]
    assert result.condition[:2] == (False, "TokensDiffer") and result.unverified == frozenset({1}), result
