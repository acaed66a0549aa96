"""The memory plan of whole specs: the V3 example on H200, the flags it reads, how a spec names its
model and its GPU."""
from __future__ import annotations

import copy
import json
import pathlib
import random
import subprocess
import sys

import pytest
import torch
import yaml

from deepseek_pd.units import GIB
from deepseek_pd.cli import main
from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.pool import bytes_per_pool_page
from deepseek_pd.model.kv.pool_sizing import pages_for_budget
from deepseek_pd.model.speculative.mtp_names import kv_layers
from deepseek_pd.operator.gpu_types import gpu_memory, product_memory_bytes
from deepseek_pd.operator.known_models import KNOWN_MODELS, model_config, recognise
from deepseek_pd.operator.memory_flags import parse_memory_flags
from deepseek_pd.operator.memory_plan import plan_memory
from deepseek_pd.operator.spec import DeploymentSpec, InvalidSpecError
from deepseek_pd.operator.weight_bytes import WeightFormat, rank_weights
from deepseek_pd.workers.serve.flag_rules import check_flags
from deepseek_pd.workers.serve.flags import ServeFlags

pytestmark = pytest.mark.timeout(60)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())["spec"]


def _plan(raw: dict):
    return plan_memory(DeploymentSpec.parse("x", "llm", raw))


def _one_node(raw: dict, *engine_args: str) -> dict:
    """The V3 example with prefill on one 8-GPU node (EP8)."""
    raw = copy.deepcopy(raw)
    raw["prefill"].update(size=1, parallelism={"tp": 1, "dp": 8, "ep": 8}, engineArgs=list(engine_args))
    return raw


def test_the_v3_example_fits_on_h200_in_fp8():
    verdict = _plan(_example("deepseek-v3-h200.yaml"))
    assert (verdict.status, verdict.reason) == (True, "Fits")
    assert [r.role for r in verdict.ranks] == ["prefill", "decode"]
    assert all(r.fp8 for r in verdict.ranks)
    assert "DeepSeek-V3 on NVIDIA-H200" in verdict.message and "prefill (16 rank(s), FP8" in verdict.message


def test_v3_in_bf16_on_one_node_does_not_fit_and_in_fp8_it_does():
    raw = _example("deepseek-v3-h200.yaml")
    bf16 = _plan(_one_node(raw, "--engine-opt", "fp8_backend=dequant"))
    assert (bf16.status, bf16.reason) == (False, "DoesNotFit")
    prefill = bf16.ranks[0]
    assert not prefill.fp8 and not prefill.fits
    # Independently of the plan's formula: 8 ranks share 671.0B bf16 values (HF's count, see
    # test_weight_bytes) of which the routed experts are split, so each holds more than 671.0B * 2 / 8.
    assert prefill.weights_bytes > 671.0e9 * 2 / 8 > prefill.budget_bytes
    fp8 = _plan(_one_node(raw))
    assert fp8.status is True and fp8.ranks[0].fits
    assert fp8.ranks[0].weights_bytes < prefill.weights_bytes / 1.9


def test_fitting_agrees_with_the_workers_own_pool_sizing():
    """The plan fits exactly when the worker's pages_for_budget finds room for the minimum pool."""
    rng = random.Random()
    raw = _one_node(_example("deepseek-v3-h200.yaml"))
    for _ in range(8):
        fraction, headroom = round(rng.uniform(0.5, 0.95), 3), rng.choice([0, 2, 8, 20])
        raw["prefill"]["engineArgs"] = [f"--mem-fraction-static={fraction}",
                                        f"--engine-opt=mem_headroom_gib={headroom}"]
        rank = _plan(raw).ranks[0]
        page = 16 * rank.kv_bytes_per_token
        min_pages = model_config("DeepSeek-V3").max_position_embeddings // 16
        try:
            # the staging beside the pool as the worker resolves it (equal: test_operator_group_layout.py
            # test_the_memory_plan_reserves_the_staging_the_worker_resolves)
            pages_for_budget(rank.budget_bytes, page, rank.weights_bytes, headroom * GIB, min_pages,
                             reserve_bytes=rank.staging_bytes)
            worker_fits = True
        except UserError:  # the worker's "no room for the KV pool"
            worker_fits = False
        assert rank.fits == worker_fits, (fraction, headroom)
        assert rank.budget_bytes == int(fraction * int(139.8 * GIB))  # as pages_for_gpu multiplies


def test_kv_bytes_per_token_is_the_pools():
    config = model_config("DeepSeek-V3")
    rank = _plan(_example("deepseek-v3-h200.yaml")).ranks[0]
    # the example speculates: the pool holds the MTP layer's KV too (model/speculative/mtp_names.py)
    assert rank.kv_bytes_per_token == bytes_per_pool_page(kv_layers(config, True), 1, config.kv_cache_dim,
                                                          torch.bfloat16)
    raw = _example("deepseek-v3-h200.yaml")
    raw["decode"]["engineArgs"] = ["--page-size", "64", "--max-total-tokens", "1000"]
    decode = _plan(raw).ranks[1]
    assert decode.kv_bytes == 1024 * decode.kv_bytes_per_token  # whole 64-token pages
    assert "fixed pool of 1024 tokens" in decode.describe()


def test_cpu_specs_are_not_applicable():
    verdict = _plan(_example("cpu-minimal.yaml"))
    assert (verdict.status, verdict.reason) == (True, "NotApplicable")


def test_unknown_model_or_gpu_is_unknown_and_not_refused():
    raw = _example("deepseek-v3-h200.yaml")
    raw["model"].update(path="my-weights", servedName="chat")
    verdict = _plan(raw)
    assert (verdict.status, verdict.reason, verdict.refused) == (None, "ModelUnknown", False)
    raw["model"]["architecture"] = "DeepSeek-V3"
    assert _plan(raw).status is True
    raw["scheduling"] = {}
    verdict = _plan(raw)
    assert (verdict.status, verdict.reason) == (None, "GpuUnknown")
    assert "nvidia.com/gpu.product" in verdict.message


def test_ep_that_does_not_divide_the_experts_and_bad_flags_are_refused():
    raw = _example("deepseek-v3-h200.yaml")
    raw["model"].pop("numRoutedExperts")  # else the CRD rule catches it first
    raw["decode"].update(size=3, parallelism={"tp": 1, "dp": 24, "ep": 24})
    assert _plan(raw).reason == "InvalidLayout"
    raw = _example("deepseek-v3-h200.yaml")
    raw["prefill"]["engineArgs"] = ["--num-pages=many"]
    verdict = _plan(raw)
    assert (verdict.status, verdict.reason) == (False, "InvalidEngineArgs")
    assert "--num-pages" in verdict.message


def test_an_unknown_architecture_is_an_invalid_spec():
    raw = _example("deepseek-v3-h200.yaml")
    raw["model"]["architecture"] = "DeepSeek-V9"
    with pytest.raises(InvalidSpecError, match="spec.model.architecture"):
        DeploymentSpec.parse("x", "llm", raw)


def test_the_operator_plans_without_importing_torch():
    code = ("import sys, yaml; from deepseek_pd.operator import handlers; "
            "from deepseek_pd.operator.memory_plan import plan_memory; "
            "from deepseek_pd.operator.spec import DeploymentSpec; "
            f"raw = yaml.safe_load(open({str(EXAMPLES / 'deepseek-v3-h200.yaml')!r}))['spec']; "
            "assert plan_memory(DeploymentSpec.parse('x', 'llm', raw)).status is True; "
            "assert 'torch' not in sys.modules, 'the operator imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_architecture_does_not_change_the_pods_revision():
    raw = _example("deepseek-v3-h200.yaml")
    before = DeploymentSpec.parse("x", "llm", raw).role_revision("decode")
    raw["model"]["architecture"] = "DeepSeek-V3"
    assert DeploymentSpec.parse("x", "llm", raw).role_revision("decode") == before


@pytest.mark.parametrize("name, expected", [
    ("deepseek-ai/DeepSeek-V3", "DeepSeek-V3"), ("DeepSeek-V3-0324", "DeepSeek-V3"),
    ("deepseek-ai/DeepSeek-R1-0528", "DeepSeek-V3"), ("DeepSeek-V3.1-Terminus", "DeepSeek-V3"),
    ("deepseek-v2-lite-chat", "DeepSeek-V2-Lite"), ("DeepSeek-V2.5-1210", "DeepSeek-V2"),
    ("DeepSeek-Coder-V2-Lite-Instruct", "DeepSeek-V2-Lite"), ("deepseek-v2", "DeepSeek-V2"),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", None), ("DeepSeek-V3.2-Exp", None),
    ("deepseek-v30", None), ("tiny", None), ("", None),
])
def test_model_names_are_recognised(name, expected):
    assert recognise(name) == expected


def test_gpu_memory_from_labels():
    assert gpu_memory({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}}).total_bytes == int(139.8 * GIB)
    # The memory label wins over the product, in MiB.
    both = gpu_memory({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.memory": "81559"}})
    assert both.total_bytes == 81559 << 20
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                               "values": ["NVIDIA-H200", "NVIDIA-A100-SXM4-40GB"]}]}]}}}
    smallest = gpu_memory({"affinity": affinity})
    assert (smallest.name, smallest.source) == ("NVIDIA-A100-SXM4-40GB", "scheduling.affinity")
    assert product_memory_bytes("NVIDIA-H100-80GB-HBM3") == product_memory_bytes("NVIDIA-H800")
    assert product_memory_bytes("NVIDIA-H100-NVL") is None and product_memory_bytes("Tesla-T4") is None
    assert gpu_memory({"nodeSelector": {"nvidia.com/gpu.product": "Tesla-T4"}}) is None
    assert gpu_memory({}) is None


def test_flags_are_read_in_both_spellings_as_the_worker_reads_them():
    flags = parse_memory_flags("decode", ["--chunked-prefill-size=16384", "--dtype", "float16", "--engine-opt",
                                          "fp8_backend=dequant", "--engine-opt=max_running_requests=32",
                                          "--page-size=64", "--num-pages", "10"])
    assert (flags.serve.dtype, flags.fp8_backend, flags.serve.page_size, flags.fixed_pool_tokens) == (
        "float16", "dequant", 64, 640)
    assert flags.max_running_requests == 32 and flags.serve.chunked_prefill_size == 16384
    for bad in (["--dtype", "int8"], ["--page-size"], ["--engine-opt", "fp8_backend=magic"],
                ["--mem-fraction-static=1.5"], ["--max-total-tokens=0"], ["--kv-share=0"],
                ["--no-such-flag"]):  # the worker would refuse an unknown flag too
        with pytest.raises(ValueError):
            parse_memory_flags("prefill", bad)


def test_the_memory_plan_refuses_what_serve_refuses_in_its_words():
    """The memory plan applies `serve`'s own flag rules (workers/serve/flag_rules.py), not a copy of
    some of them: each command line serve refuses from its flags alone is the plan's error, with
    serve's message; the memory settings' ranges are the runner's own rule (RunnerConfig says the same)."""
    refused = [("prefill", ["--engine-opt", "cuda_graph=true"]),
               ("decode", ["--deterministic", "--enable-tbo"]),
               ("decode", ["--deterministic", "--engine-opt", "prefix_cache=true"]),
               ("decode", ["--engine-opt", "cuda_graph=true", "--engine-opt", "record_expert_load=yes"]),
               ("decode", ["--engine-opt", "ep_size=2"]),
               ("prefill", ["--num-pages", "0"]), ("decode", ["--max-total-tokens=-1"]),
               ("decode", ["--page-size=0"]), ("prefill", ["--mem-fraction-static=1.5"]), ("decode", ["--kv-share=0"]),
               ("decode", ["--engine-opt", "mem_headroom_gib=-1"]), ("prefill", ["--ep-num-redundant-experts=-2"]),
               ("decode", ["--engine-opt", "fp8_backend=magic"]), ("prefill", ["--engine-opt", "speculative_num_steps=9"]),
               # the options the plan reads whose ranges the configs hold (deepseek_pd/bounds.py); before,
               # the plan restated them in words of its own
               ("decode", ["--engine-opt", f"max_running_requests={-random.randrange(3)}"]),
               ("decode", ["--engine-opt=cuda_graph_max_batch=0"]),
               ("prefill", ["--engine-opt", f"mooncake_staging_tokens={-random.randrange(3)}"]),
               ("decode", [f"--chunked-prefill-size={-random.randrange(3)}"])]
    for role, args in random.sample(refused, len(refused)):
        with pytest.raises(UserError) as serve:
            check_flags(ServeFlags.from_argv([role, *args]))
        with pytest.raises(ValueError) as plan:
            parse_memory_flags(role, args)
        assert str(plan.value) == str(serve.value), args


def test_redundant_experts_in_engine_args_add_their_weights_per_rank():
    """`--ep-num-redundant-experts R` (either spelling) adds R / ep expert slots to each rank's
    weights, against the slots the built model holds (tests/operator/test_weight_bytes.py); an ep
    that does not divide E + R is an invalid layout, a negative R an invalid flag."""
    raw = _example("deepseek-v3-h200.yaml")
    raw["decode"]["speculative"] = {"numSteps": 0}  # no MTP layer (with it: test_speculative_spec.py)
    ep = raw["prefill"]["parallelism"]["ep"]
    redundant = ep * random.randint(1, 4)
    base = _plan(raw).ranks[0]
    spelling = random.choice([[f"--ep-num-redundant-experts={redundant}"], ["--ep-num-redundant-experts", str(redundant)]])
    raw["prefill"]["engineArgs"] = list(raw["prefill"].get("engineArgs") or []) + spelling
    more = _plan(raw).ranks[0]
    experts = rank_weights(model_config("DeepSeek-V3"), WeightFormat(2, (128, 128)), ep).expert_bytes
    assert more.weights_bytes - base.weights_bytes == experts * redundant // 256
    assert f"{more.weights_bytes / GIB:.1f} GiB" in _plan(raw).message
    raw["prefill"]["engineArgs"][-1] = spelling[-1].replace(str(redundant), str(redundant + 1))
    verdict = _plan(raw)
    assert (verdict.status, verdict.reason) == (False, "InvalidLayout")
    assert f"{redundant + 1} redundant" in verdict.message
    raw["prefill"]["engineArgs"] = ["--ep-num-redundant-experts=-1"]
    assert _plan(raw).reason == "InvalidEngineArgs"


def test_the_replicated_share_is_what_ep1_holds_beyond_the_experts():
    """A cross-check of the split the plan relies on, with V2-Lite (bf16, no FP8)."""
    config = model_config("DeepSeek-V2-Lite")
    whole = rank_weights(config, WeightFormat(2), 1)
    spread = rank_weights(config, WeightFormat(2), 64)
    assert whole.total_bytes - spread.total_bytes == 63 * spread.expert_bytes


def test_plan_command_reads_a_local_config_json(tmp_path, capsys):
    """`deepseek-pd operator plan`: the model from --model-dir's config.json; exit 1 when refused."""
    manifest = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())
    manifest["spec"] = _one_node(manifest["spec"])
    manifest["spec"]["model"].update(path="weights", servedName="chat")  # names the operator does not know
    (tmp_path / "dsd.yaml").write_text(yaml.safe_dump(manifest))
    assert main(["operator", "plan", str(tmp_path / "dsd.yaml")]) == 0
    assert "MemoryPlanFits: Unknown (ModelUnknown)" in capsys.readouterr().out

    for quantized, code in ((True, 0), (False, 1)):  # the same shape stored in bf16 does not fit
        config = dict(KNOWN_MODELS["DeepSeek-V3"])
        if not quantized:
            config.pop("quantization_config")
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert main(["operator", "plan", str(tmp_path / "dsd.yaml"), "--model-dir", str(tmp_path)]) == code
        out = capsys.readouterr().out
        assert out.startswith(f"MemoryPlanFits: {bool(code == 0)} ") and str(tmp_path) in out


def test_an_unset_page_size_is_planned_at_the_largest_page_a_worker_may_default_to():
    """The operator cannot see whether a pod's machine runs FlashMLA (64-token pages by default,
    model/kv/page_size.py) or not (16), so a pool of N pages, or of T tokens rounded up to pages, is
    planned in 64-token pages: never less KV than the worker allocates."""
    pages, tokens = random.randint(1, 10_000), random.randint(1, 1_000_000)
    assert parse_memory_flags("decode", ["--num-pages", str(pages)]).fixed_pool_tokens == pages * 64
    assert parse_memory_flags("prefill", [f"--max-total-tokens={tokens}"]).fixed_pool_tokens == -(-tokens // 64) * 64
    given = random.choice([1, 16, 32])
    assert parse_memory_flags("decode", ["--num-pages", str(pages), f"--page-size={given}"]).fixed_pool_tokens == \
        pages * given
