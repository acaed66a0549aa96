"""`decode.speculative` in the CRD: rendered into both roles' `serve` flags through the serve contract,
rolling both roles, and counted by the memory plan (the MTP layer's weights and its latent KV),
checked against what a real `ModelRunner` with its MTP layer holds."""
from __future__ import annotations

import copy
import pathlib
import random

import pytest
import torch
import yaml

from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.speculative.rules import MAX_SPECULATIVE_NUM_STEPS
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.operator.build_workers import build_worker_args
from deepseek_pd.operator.memory_plan import plan_memory
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.operator.validation import validate_object
from deepseek_pd.workers.serve.flags import ServeFlags

pytestmark = pytest.mark.timeout(120)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _single_rank_gpu(steps: int | None) -> dict:
    """cpu-minimal on one H200 per group (one rank each: what speculation runs in today)."""
    raw = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())
    spec = raw["spec"]
    for role in ("prefill", "decode"):
        spec[role].update(gpusPerPod=1, size=1)
    spec["scheduling"] = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}}
    if steps is not None:
        spec["decode"]["speculative"] = {"numSteps": steps}
    return raw


def _steps_in(args: list[str]) -> int:
    assert args[0] == "serve"
    return ServeFlags.from_argv(args[1:]).speculative_num_steps


def test_num_steps_reaches_both_roles_and_rolls_both():
    steps = random.randint(1, MAX_SPECULATIVE_NUM_STEPS)
    off = DeploymentSpec.parse("demo", "llm", _single_rank_gpu(None)["spec"])
    on = DeploymentSpec.parse("demo", "llm", _single_rank_gpu(steps)["spec"])
    assert off.speculative_num_steps == 0 and on.speculative_num_steps == steps
    for role in ("prefill", "decode"):
        assert _steps_in(build_worker_args(off, off.role(role))) == 0
        assert "--speculative-num-steps" not in build_worker_args(off, off.role(role))
        assert _steps_in(build_worker_args(on, on.role(role))) == steps
        # a prefill worker runs the MTP layer too: its pods change with decode's setting
        assert off.role_revision(role) != on.role_revision(role)


@pytest.mark.parametrize("steps, field, words", [
    (MAX_SPECULATIVE_NUM_STEPS + 1, "spec.decode.speculative.numSteps", "maximum"),
    (-1, "spec.decode.speculative.numSteps", "minimum"),
])
def test_out_of_range_steps_are_refused(steps, field, words):
    assert validate_object(_single_rank_gpu(MAX_SPECULATIVE_NUM_STEPS)) == []
    violations = validate_object(_single_rank_gpu(steps))
    assert any(v.field == field and words in v.message for v in violations), violations


def test_ep_and_attention_tp_groups_are_taken_and_engine_args_are_refused():
    """Speculation runs in every group layout (DP attention, EP, attention TP: the lockstep tick
    says which network each step runs, TP followers replay the draft and verify forwards): the V3
    example turns it on; the flag is the operator's (engineArgs may not repeat it); prefill has no
    field."""
    v3 = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())
    assert v3["spec"]["decode"]["speculative"]["numSteps"] > 0 and validate_object(v3) == []
    for role, parallelism in (("prefill", {"tp": 2}), ("decode", {"tp": 2, "ep": 2}), ("decode", {"dp": 1})):
        raw = _single_rank_gpu(2)
        raw["spec"][role].update(gpusPerPod=2, parallelism=parallelism)
        assert validate_object(raw) == [], (role, parallelism)
    raw = _single_rank_gpu(2)
    for role in ("prefill", "decode"):  # DP attention and EP over 2 pods x 2 GPUs
        raw["spec"][role].update(size=2, gpusPerPod=2, parallelism={"dp": 4, "ep": 4})
    assert validate_object(raw) == []
    raw = _single_rank_gpu(None)
    raw["spec"]["decode"]["engineArgs"] = ["--speculative-num-steps=2"]
    assert any(v.field == "spec.decode.engineArgs" and "must not set flags" in v.message
               for v in validate_object(raw))
    raw = _single_rank_gpu(None)
    raw["spec"]["prefill"]["speculative"] = {"numSteps": 2}
    assert any(v.field == "spec.prefill" and "speculative" in v.message for v in validate_object(raw))


def _held_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("speculative", [False, True])
def test_the_plan_counts_what_the_runner_holds(tmp_path, speculative):
    """The oracle: a ModelRunner built from a tiny checkpoint with an MTP layer, as the worker builds
    it (`speculative_num_steps` > 0 loads the MTP layer and adds its pool layer); the plan's weights
    and KV bytes per token for the same flags must equal what it holds."""
    seed = random.randrange(1 << 30)
    path = make_tiny_model(tmp_path / "tiny", seed=seed, mtp_layers=1)
    steps = random.randint(1, 3) if speculative else 0
    runner = ModelRunner(RunnerConfig(model=str(path), dtype="float32", device="cpu", num_pages=8,
                                      speculative_num_steps=steps))
    assert (runner.model.mtp is not None) == speculative
    raw = _single_rank_gpu(steps)["spec"]
    for role in ("prefill", "decode"):
        raw[role]["engineArgs"] = ["--dtype=float32"]
    verdict = plan_memory(DeploymentSpec.parse("demo", "llm", raw),
                          model=("tiny", ModelConfig.from_hf(path)))
    assert verdict.status is True, verdict.message
    for rank in verdict.ranks:
        what = f"seed {seed}, steps {steps}, {rank.role}"
        assert rank.weights_bytes == _held_bytes(runner.model), what
        assert rank.kv_bytes_per_token == runner.kv_pool.bytes_per_token, what


def test_the_engine_opt_spelling_counts_too():
    raw = _single_rank_gpu(None)["spec"]
    plain = plan_memory(DeploymentSpec.parse("demo", "llm", copy.deepcopy(raw)), model=None)
    raw["model"]["architecture"] = "DeepSeek-V3"
    raw["decode"]["engineArgs"] = ["--engine-opt", "speculative_num_steps=2"]
    verdict = plan_memory(DeploymentSpec.parse("demo", "llm", raw))
    prefill, decode = verdict.ranks
    assert decode.weights_bytes > prefill.weights_bytes and decode.kv_bytes_per_token > prefill.kv_bytes_per_token
    assert decode.kv_bytes_per_token * 61 == prefill.kv_bytes_per_token * 62  # V3: 61 layers, MTP one more
    assert plain.status is None  # cpu-minimal names no known model: the V3 plan above is the one read
    raw["decode"]["engineArgs"] = ["--engine-opt", f"speculative_num_steps={MAX_SPECULATIVE_NUM_STEPS + 1}"]
    refused = plan_memory(DeploymentSpec.parse("demo", "llm", raw))
    assert (refused.status, refused.reason) == (False, "InvalidEngineArgs")
    assert "--speculative-num-steps must be an integer" in refused.message


def test_eplb_placements_are_taken_with_speculation():
    """The MTP layer's MoE has its own row in an EPLB placement (model/eplb/expert_location.py):
    redundant experts pass the memory plan with speculation, which counts the MTP layer's extra
    expert slots as one MoE layer more (V3: 58 MoE decoder layers, the MTP layer's is the 59th),
    and a mounted placement passes the CRD."""
    raw = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())
    decode = raw["spec"]["decode"]
    extra = {}
    for steps in (0, decode["speculative"]["numSteps"]):
        decode["speculative"] = {"numSteps": steps}
        weights = []
        for args in ([], ["--ep-num-redundant-experts=32"]):
            decode["engineArgs"] = args
            verdict = plan_memory(DeploymentSpec.parse("demo", "llm", copy.deepcopy(raw["spec"])))
            assert verdict.status is True, verdict.message
            weights.append(verdict.ranks[1].weights_bytes)
        extra[steps] = weights[1] - weights[0]
    assert extra[0] > 0 and extra[3] * 58 == extra[0] * 59, extra
    decode["engineArgs"] = []
    raw["spec"]["prefill"]["eplb"] = {"initExpertLocation": {"configMapName": "placement", "key": "p.json"}}
    decode["eplb"] = {"initExpertLocation": {"configMapName": "placement", "key": "d.json"}}
    assert validate_object(raw) == []
