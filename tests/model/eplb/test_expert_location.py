"""Redundant experts and static placements in one process: bad placement files are clear errors
(naming the file, layer and slot), `serve` refuses them before any rank starts, a replicated and
permuted placement gives the same logits as the plain model, every slot holds its logical
expert's weights (per-expert and stacked checkpoints), and replicas share a hot expert's tokens."""
from __future__ import annotations

import json
import random

import pytest
import torch

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.errors import UserError
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.eplb.expert_location import ExpertLocation, moe_layer_ids, resolve_expert_location
from deepseek_pd.model.eplb.replica_dispatch import ReplicaDispatch
from deepseek_pd.model.checkpoint.loader import iter_checkpoint_tensors
from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.workers.serve.resolution import ParallelFlags, ServeFlags, resolve_serve_config
from pdtest.eplb_placement import random_placement

pytestmark = pytest.mark.timeout(120)
PAGE = 4


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_hf(resolve_model_dir("tiny"))  # 8 routed experts, MoE layers 1-3 of 4


def _valid_rows(config: ModelConfig, redundant: int) -> list[list[int]]:
    return random_placement(random.Random(), config.n_routed_experts, redundant, len(moe_layer_ids(config)))


def _broken(kind: str, config: ModelConfig) -> tuple[object, int, int, str]:
    """(file content, ep_size, redundant, the error it must give)."""
    rows = _valid_rows(config, 2)
    if kind == "wrong_length":
        rows[1] = rows[1][:-1]
        return {"physical_to_logical_map": rows}, 2, 2, r"MoE layer 2 has 9 physical slots; expected .* = 10"
    if kind == "unknown_expert":
        rows[0][3] = 8
        return {"physical_to_logical_map": rows}, 2, 2, r"MoE layer 1, slot 3: 8 is not a logical expert id in \[0, 8\)"
    if kind == "not_an_id":
        rows[2][0] = "7"
        return {"physical_to_logical_map": rows}, 2, 2, r"MoE layer 3, slot 0: '7' is not a logical expert id"
    if kind == "no_replica":
        rows[2] = [e if e != 5 else 6 for e in rows[2]]
        return {"physical_to_logical_map": rows}, 2, 2, r"MoE layer 3: logical expert\(s\) \[5\] have no physical slot"
    if kind == "not_divisible":
        rows = _valid_rows(config, 1)
        return ({"physical_to_logical_map": rows}, 2, 1,
                "9 physical expert slots per layer are not divisible by ep_size 2")
    if kind == "row_count":
        return ({"physical_to_logical_map": rows[:2]}, 2, 2,
                "2 rows in physical_to_logical_map; the model has 3 MoE layers")
    if kind == "other_ep_size":
        return {"physical_to_logical_map": rows, "ep_size": 4}, 2, 2, "planned for ep_size 4, but this worker has 2"
    if kind == "no_map":
        return {"rows": rows}, 2, 2, "expected a JSON object with a 'physical_to_logical_map' list"
    raise AssertionError(kind)


KINDS = ["wrong_length", "unknown_expert", "not_an_id", "no_replica", "not_divisible", "row_count", "other_ep_size",
         "no_map"]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_placement_files_are_clear_user_errors(tmp_path, tiny, kind):
    content, ep_size, redundant, message = _broken(kind, tiny)
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(content))
    with pytest.raises(UserError, match=message) as info:
        resolve_expert_location(tiny, ep_size, redundant, str(path))
    assert str(path) in str(info.value)


def test_unreadable_files_and_bad_counts(tmp_path, tiny):
    with pytest.raises(UserError, match="cannot read it"):
        resolve_expert_location(tiny, 2, 0, str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        resolve_expert_location(tiny, 2, 0, str(tmp_path / "bad.json"))
    with pytest.raises(UserError, match="ep_num_redundant_experts must be >= 0"):
        RunnerConfig(ep_num_redundant_experts=-1)
    with pytest.raises(UserError, match="9 physical expert slots per layer are not divisible by ep_size 2"):
        resolve_expert_location(tiny, 2, 1, None)  # the trivial placement is checked the same way


def test_sglang_layout_with_dense_rows_is_accepted(tmp_path, tiny):
    rows = _valid_rows(tiny, 2)
    full = [[p % 8 for p in range(10)]] + rows  # layer 0 is dense: SGLang still writes a (trivial) row for it
    path = tmp_path / "sglang.json"
    path.write_text(json.dumps({"physical_to_logical_map": full}))
    location = resolve_expert_location(tiny, 2, 2, str(path))
    assert [list(location.row(layer)) for layer in (1, 2, 3)] == rows


def test_serve_refuses_a_bad_placement_before_starting(tmp_path):
    content, *_ = _broken("no_replica", ModelConfig.from_hf(resolve_model_dir("tiny")))
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(content))
    flags = ServeFlags(role="decode", model="tiny", device="cpu",
                       parallel=ParallelFlags(dp=2, ep=2, ep_num_redundant_experts=2, init_expert_location=str(path)))
    with pytest.raises(UserError, match="have no physical slot"):
        resolve_serve_config(flags)
    rows = _valid_rows(ModelConfig.from_hf(resolve_model_dir("tiny")), 2)
    path.write_text(json.dumps({"physical_to_logical_map": rows}))
    args = build_parser().parse_args(["serve", "decode", "--device", "cpu", "--dp", "2", "--ep", "2",
                                      "--ep-num-redundant-experts", "2", "--init-expert-location", str(path)])
    runner = resolve_serve_config(flags_from_args(args)).runner
    assert (runner.ep_num_redundant_experts, runner.init_expert_location) == (2, str(path.resolve()))


def _run(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    pages = [runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(p) + 2)) for p in prompts]
    out = [runner.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)])]
    next_ids = out[0].argmax(-1).tolist()
    out.append(runner.decode([DecodeSeq(t, len(p), pg) for t, p, pg in zip(next_ids, prompts, pages)]))
    return out


def test_replicated_permuted_experts_give_the_same_logits(tmp_path, tiny):
    rng = random.Random()
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"physical_to_logical_map": _valid_rows(tiny, 3)}))
    base = RunnerConfig(model="tiny", page_size=PAGE, num_pages=64)
    plain = ModelRunner(base)
    placed = ModelRunner(RunnerConfig(model="tiny", page_size=PAGE, num_pages=64, ep_num_redundant_experts=3,
                                      init_expert_location=str(path)))
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(2, 4))]
    for want, got in zip(_run(plain, prompts), _run(placed, prompts)):
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def _stacked(tensors):
    """The checkpoint's per-expert tensors as HF's stacked in-memory form (gate_up_proj, down_proj)."""
    per_layer: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors:
        if ".mlp.experts." not in name:
            yield name, tensor
            continue
        prefix, rest = name.split(".mlp.experts.")
        expert, kind = rest.split(".")[:2]
        per_layer.setdefault(prefix, {}).setdefault(int(expert), {})[kind] = tensor
    for prefix, experts in per_layer.items():
        order = [experts[j] for j in sorted(experts)]
        gate_up = [torch.cat([e["gate_proj"], e["up_proj"]]) for e in order]
        yield f"{prefix}.mlp.experts.gate_up_proj", torch.stack(gate_up)
        yield f"{prefix}.mlp.experts.down_proj", torch.stack([e["down_proj"] for e in order])


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_every_slot_holds_a_copy_of_its_logical_expert(tiny, stacked):
    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.deepseek import DeepseekForCausalLM

    rows = _valid_rows(tiny, 4)
    location = ExpertLocation(tiny.n_routed_experts, 1, moe_layer_ids(tiny), tuple(map(tuple, rows)))
    directory = resolve_model_dir("tiny")
    plain = DeepseekForCausalLM(tiny)
    plain.load_weights(iter_checkpoint_tensors(directory, tiny, progress=False))
    placed = DeepseekForCausalLM(tiny, BuildOptions(expert_location=location))
    tensors = iter_checkpoint_tensors(directory, tiny, progress=False)
    placed.load_weights(_stacked(tensors) if stacked else tensors)
    for layer, row in zip((placed.layers[i] for i in location.moe_layer_ids), rows):
        full = plain.layers[layer.layer_id].mlp.experts
        assert layer.mlp.experts.num_experts == 12
        assert torch.equal(layer.mlp.experts.w13, full.w13[torch.tensor(row)])
        assert torch.equal(layer.mlp.experts.w2, full.w2[torch.tensor(row)])


def test_replicas_share_a_hot_experts_tokens():
    rng = random.Random()
    num_logical, ep_size = 6, 3
    row = random_placement(rng, num_logical, 3, 1)[0]
    location = ExpertLocation(num_logical, ep_size, (0,), (tuple(row),))
    rank = rng.randrange(ep_size)
    dispatch = ReplicaDispatch.for_layer(location, 0, rank, "cpu")
    ids = torch.randint(0, num_logical, (rng.randint(1, 50), 2))
    slots = dispatch(ids)
    assert torch.equal(torch.tensor(row)[slots], ids)  # every slot computes the expert the router chose
    hot = max(range(num_logical), key=lambda e: row.count(e))
    used = dispatch(torch.full((7 * row.count(hot), 1), hot)).reshape(-1)
    per_replica = torch.bincount(used, minlength=len(row))[torch.tensor(location.replicas(0)[hot])]
    assert per_replica.tolist() == [7] * row.count(hot)  # all replicas, evenly


def test_fp8_experts_kept_in_fp8_are_copied_into_every_replica(tmp_path, tiny):
    """Kept-FP8 experts: each replica gets the expert's FP8 bytes and its block scales."""
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    directory = make_tiny_model(tmp_path / "fp8", seed=random.randrange(10_000), fp8_block=(128, 128))
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"physical_to_logical_map": _valid_rows(tiny, 2)}))
    common = dict(model=str(directory), fp8_backend="torch", page_size=PAGE, num_pages=64)
    plain = ModelRunner(RunnerConfig(**common))
    placed = ModelRunner(RunnerConfig(**common, ep_num_redundant_experts=2, init_expert_location=str(path)))
    for layer in (placed.model.layers[i] for i in (1, 2, 3)):
        row = torch.tensor(layer.mlp.placement.local_logical(layer.layer_id))
        full = dict(plain.model.layers[layer.layer_id].mlp.experts.named_parameters())
        mine = dict(layer.mlp.experts.named_parameters())
        assert {p.dtype for p in mine.values()} == {torch.float8_e4m3fn, torch.float32}  # weights and scales
        for name, param in mine.items():  # bytes compared: torch.equal has no FP8 kernel on every build
            assert torch.equal(param.view(torch.uint8), full[name][row].view(torch.uint8)), (layer.layer_id, name)
    prompts = [[random.randrange(3, 256) for _ in range(random.randint(1, 9))] for _ in range(3)]
    for want, got in zip(_run(plain, prompts), _run(placed, prompts)):
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_ranks_with_different_placement_files_disagree(tmp_path, tiny):
    from deepseek_pd.workers.serve.group_main import agreement_of, check_agreement

    configs = []
    for rank in range(2):
        path = tmp_path / f"node{rank}.json"
        path.write_text(json.dumps({"physical_to_logical_map": _valid_rows(tiny, 2)}))
        parallel = ParallelFlags(dp=2, ep=2, ep_num_redundant_experts=2, init_expert_location=str(path))
        configs.append(resolve_serve_config(ServeFlags(role="decode", model="tiny", device="cpu", parallel=parallel)))
    mine, theirs = (agreement_of(c) for c in configs)
    check_agreement([mine, dict(mine)], 0)
    with pytest.raises(UserError, match="rank 1 resolved expert_location_sha256"):
        check_agreement([mine, theirs], 1)
