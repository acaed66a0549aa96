"""The body of one gloo rank in `test_ep.py` (a module of its own so spawned children import only
torch and deepseek_pd, not pytest or transformers).

Each rank builds, from the same checkpoint, the single-process reference (ep_size 1, `local`) and
four variants — EP (normal layout), EP in the low-latency layout for every step, TBO alone, and
EP+TBO in the `auto` dispatch mode (normal extend, low-latency decode) — and drives all five through
the same calls on its own tokens (data-parallel attention): extend, extend-with-prefix
(MHA_CHUNKED_KV), paged decode, and a step where rank 0 has a single sequence (with TBO it takes
part with an empty micro-batch) and one where the last rank is idle (`runner.idle()`: with TBO, two
empty micro-batches); then a long prompt on rank 0 in two chunked-prefill steps (TBO cuts it in two
chunks inside the sequence; the second step has a cached prefix) while the last rank extends one
token, then is idle; and a step where every rank extends one token (below the TBO floor: plain
everywhere). Logits, the TBO paths each step took (`tbo_paths`: overlapped forwards and non-empty
micro-batches of the `ep_tbo` runner), weight-shard checks, and the dispatchers' edge cases in both
layouts (plus the masked layout against an all-gathered oracle, and a refused over-capacity step)
are written to `<dir>/rank<r>.pt`; the parent test compares them.
"""
from __future__ import annotations

import dataclasses
import datetime
import random
from pathlib import Path
from typing import Any

import torch

from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.errors import UserError
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.distributed.dispatch_mode import DispatchConfig, DispatchMode
from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.moe.dispatcher import DISPATCHERS, CombineInput
from deepseek_pd.model.distributed.parallel import ExpertPlacement, ParallelInfo
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.distributed.tbo import TwoBatchOverlap

GLOO_TIMEOUT = datetime.timedelta(seconds=60)
VARIANTS = ("ep", "ep_low_latency", "tbo", "ep_tbo")
# Tokens per rank per step in the low-latency layout: the scenario's largest step is 4 sequences
# of up to 9 tokens (36), so the fixed buffers are mostly padding, as in a real decode step.
LOW_LATENCY_CAPACITY = 40


def per_expert_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's stacked expert tensors rewritten in the per-expert form `save_pretrained` checkpoints use."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[:-len("gate_up_proj")], tensor.shape[1] // 2
            for j in range(tensor.shape[0]):
                out[f"{prefix}{j}.gate_proj.weight"] = tensor[j, :inter].clone()
                out[f"{prefix}{j}.up_proj.weight"] = tensor[j, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for j in range(tensor.shape[0]):
                out[f"{prefix}{j}.down_proj.weight"] = tensor[j].clone()
        else:
            out[name] = tensor
    return out


def _build(config: ModelConfig, weights: dict[str, torch.Tensor], parallel: ParallelInfo, dispatcher: str,
           tbo: bool, fused: int, dispatch: DispatchConfig = DispatchConfig()) -> DeepseekForCausalLM:
    options = BuildOptions(dispatcher=dispatcher, parallel=parallel, enable_tbo=tbo, num_fused_shared_experts=fused,
                           prefix_chunk_size=3, dispatch=dispatch)  # several MHA_CHUNKED_KV steps on short prefixes
    model = DeepseekForCausalLM(config, options)
    model.load_weights(weights.items())
    return model.eval()


def _scenario(runner: ModelRunner, rank: int, world: int, seed: int, vocab: int,
              paths: dict[str, tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
    """The same call sequence on every rank (the all-to-alls pair up), different tokens per rank.
    `paths`, if given, gets each step's (overlapped forwards, micro-batches) of the runner's TBO."""
    rng = random.Random(seed * 1000 + rank)
    pool = runner.kv_pool
    out: dict[str, torch.Tensor] = {}
    last = rank == world - 1

    def step(case: str, call) -> None:
        tbo = runner.model.tbo
        before = dict(tbo.stats) if tbo is not None else {}
        out[case] = call()
        if paths is not None and tbo is not None:
            paths[case] = (tbo.stats["overlapped"] - before["overlapped"],
                           tbo.stats["micro_batches"] - before["micro_batches"])

    def idle(mode: ForwardMode) -> torch.Tensor:
        runner.idle(mode)
        return torch.empty(0)
    num_seqs = 2 + (rank + seed) % 3
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(num_seqs)]
    more = [[rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for _ in range(num_seqs)]
    pages = [pool.alloc(pool.pages_for_tokens(len(p) + len(m) + 4)) for p, m in zip(prompts, more)]
    step("extend", lambda: runner.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)]))
    step("extend_prefix", lambda: runner.extend([ExtendSeq(m, len(p), pg) for p, m, pg in zip(prompts, more, pages)]))
    lengths = [len(p) + len(m) for p, m in zip(prompts, more)]
    next_ids = out["extend_prefix"].argmax(-1).tolist()
    for i in range(3):
        step(f"decode{i}", lambda: runner.decode([DecodeSeq(t, n + i, pg) for t, n, pg in zip(next_ids, lengths, pages)]))
        next_ids = out[f"decode{i}"].argmax(-1).tolist()
    # Rank 0 decodes one sequence only: under TBO its first micro-batch is empty, it does not veto.
    active = 1 if rank == 0 else num_seqs
    step("decode_uneven", lambda: runner.decode(
        [DecodeSeq(t, n + 3, pg) for t, n, pg in list(zip(next_ids, lengths, pages))[:active]]))
    # The last rank has no requests this step (data-parallel attention) but joins the all-to-alls.
    # (The others redo position n+3 with the same tokens: the cache rows are rewritten identically.)
    step("decode_one_rank_idle", lambda: idle(ForwardMode.DECODE) if last else runner.decode(
        [DecodeSeq(t, n + 3, pg) for t, n, pg in zip(next_ids, lengths, pages)]))
    # One long prompt on rank 0 (the others' one token each, then the last rank idle), prefilled in
    # two chunks: TBO cuts it inside the sequence; in the second chunk after a cached prefix.
    long_prompt = [rng.randrange(vocab) for _ in range(rng.randint(14, 24))]
    chunk = rng.randint(4, 8)
    long_pages = pool.alloc(pool.pages_for_tokens(len(long_prompt)))
    one = [[rng.randrange(vocab)]]
    one_pages = pool.alloc(1)
    mine = ([ExtendSeq(long_prompt[:chunk], 0, long_pages)] if rank == 0
            else [ExtendSeq(one[0], 0, one_pages)])
    step("extend_long_first_chunk", lambda: runner.extend(mine))
    step("extend_long_second_chunk", lambda: runner.extend([ExtendSeq(long_prompt[chunk:], chunk, long_pages)])
         if rank == 0 else idle(ForwardMode.EXTEND) if last else runner.extend([ExtendSeq(one[0], 0, one_pages)]))
    # Every rank extends one token: below the TBO floor (2), so every rank runs plain.
    step("extend_one_token_each", lambda: runner.extend([ExtendSeq(one[0], 0, one_pages)]))
    return out


def expected_tbo_paths(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """What SGLang's rules make of `_scenario` on `rank`: (overlapped forwards, non-empty micro-batches)."""
    first, last = rank == 0, rank == world - 1
    split, one_sided, idle = (1, 2), (1, 1), (1, 0)
    paths = {case: split for case in ("extend", "extend_prefix", "decode0", "decode1", "decode2")}
    paths["decode_uneven"] = one_sided if first else split
    paths["decode_one_rank_idle"] = idle if last else split
    paths["extend_long_first_chunk"] = split if first else one_sided
    paths["extend_long_second_chunk"] = split if first else idle if last else one_sided
    paths["extend_one_token_each"] = (0, 0)
    return paths


def run_rank(rank: int, world: int, port: int, directory: str, seed: int, fused: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    try:
        saved: dict[str, Any] = torch.load(Path(directory) / "model.pt")
        config = ModelConfig.from_hf(saved["config"])
        stacked, per_expert = saved["state"], per_expert_names(saved["state"])
        group = ParallelInfo.from_group()
        models = {
            "reference": _build(config, stacked, ParallelInfo(), "local", False, fused),
            "ep": _build(config, per_expert, group, "all_to_all", False, fused),
            "ep_low_latency": _build(config, per_expert, group, "all_to_all", False, fused,
                                     DispatchConfig(DispatchMode.LOW_LATENCY, LOW_LATENCY_CAPACITY)),
            "tbo": _build(config, stacked, ParallelInfo(), "local", True, fused),
        }
        runner_config = RunnerConfig(model="<in-memory>", page_size=4, num_pages=128, mha_chunked_kv_threshold=1)
        runners = {name: ModelRunner.from_model(model, runner_config) for name, model in models.items()}
        # EP+TBO the way a worker builds it (from the checkpoint directory, through RunnerConfig),
        # in `--deepep-mode auto`: normal extend steps, low-latency decode steps.
        runners["ep_tbo"] = ModelRunner(dataclasses.replace(
            runner_config, model=str(Path(directory) / "checkpoint"), ep_size=world, enable_tbo=True,
            num_fused_shared_experts=fused, prefix_chunk_size=3, dispatch_mode="auto",
            low_latency_max_tokens=LOW_LATENCY_CAPACITY), parallel=group)
        paths: dict[str, tuple[int, int]] = {}
        results: dict[str, Any] = {name: _scenario(runner, rank, world, seed, config.vocab_size,
                                                   paths if name == "ep_tbo" else None)
                                   for name, runner in runners.items()}
        results["tbo_paths"] = paths
        results["shards"] = _shard_report(models["reference"], models["ep"], runners["ep_tbo"].model)
        results["tbo_micro_batches"] = _traced_micro_batches(runners["ep"], group)
        results["dispatcher_edges"] = max(_dispatcher_edge_cases(group, seed, DispatchConfig(mode, 6))
                                          for mode in (DispatchMode.NORMAL, DispatchMode.LOW_LATENCY))
        results["masked_layout"] = _masked_layout_matches_oracle(group, seed)
        results["over_capacity_refused"] = _over_capacity_is_refused(group)
        results["dispatcher_edges_after_refusal"] = _dispatcher_edge_cases(
            group, seed + 1, DispatchConfig(DispatchMode.LOW_LATENCY, 6))
        torch.save(results, Path(directory) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _shard_report(reference: DeepseekForCausalLM, *sharded: DeepseekForCausalLM) -> dict[str, bool]:
    """Per MoE layer: does each EP model hold exactly its block of routed experts (+ fused shared)?"""
    report = {}
    for index, model in enumerate(sharded):
        for full, part in zip(reference.layers, model.layers):
            if not full.is_moe:
                continue
            placement = part.mlp.placement
            first, n = placement.first_local, placement.num_local_routed
            want13 = torch.cat([full.mlp.experts.w13[first:first + n], full.mlp.experts.w13[full.mlp.num_routed:]])
            want2 = torch.cat([full.mlp.experts.w2[first:first + n], full.mlp.experts.w2[full.mlp.num_routed:]])
            report[f"model{index}.layer{full.layer_id}"] = (torch.equal(part.mlp.experts.w13, want13)
                                               and torch.equal(part.mlp.experts.w2, want2)
                                               and part.mlp.experts.num_experts == n + placement.num_fused_shared)
    return report


def _traced_micro_batches(runner: ModelRunner, group: ParallelInfo) -> list[int]:
    """Which micro-batches ran ops when every rank can split (proves the EP ranks agreed on TBO)."""
    pool, model = runner.kv_pool, runner.model
    pages = [pool.alloc(2), pool.alloc(2)]
    batch = ForwardBatch.build(ForwardMode.EXTEND, [[1, 2, 3], [4, 5]], [0, 0], pages, pool,
                               model.config.vocab_size, "cpu")
    batch.attention_method = runner.policy.choose(batch.mode, batch.prefix_lens)
    trace: list = []
    with torch.no_grad():
        TwoBatchOverlap(model, group).final_hidden(batch, trace)
    return sorted({micro for micro, _, _ in trace})


def _dispatcher_edge_cases(group: ParallelInfo, seed: int, config: DispatchConfig) -> float:
    """Dispatch/combine alone where every token picks rank 0's experts (the other ranks receive
    nothing) and the last rank has no tokens at all. With "experts" that return their input times
    the sum of the weights of the pairs they own, combine must give hidden * sum(all weights)
    (the low-latency layout hands the experts weight 1 and applies the weights in combine)."""
    gen = torch.Generator().manual_seed(seed + group.ep_rank)
    placement = ExpertPlacement(num_routed=4 * group.ep_size, num_fused_shared=0, parallel=group)
    dispatcher = DISPATCHERS.build("all_to_all", placement, config)
    num_tokens = 0 if group.ep_rank == group.ep_size - 1 else 5
    hidden = torch.randn(num_tokens, 6, generator=gen)
    ids = torch.randint(0, placement.num_local_routed, (num_tokens, 3), generator=gen)  # rank 0's experts only
    weights = torch.rand(num_tokens, 3, generator=gen)
    received = dispatcher.dispatch_b(dispatcher.dispatch_a(hidden, ids, weights))
    owned = (received.topk_weights * (received.topk_ids >= 0)).sum(dim=1, keepdim=True)
    combined = dispatcher.combine_b(dispatcher.combine_a(CombineInput(received.hidden * owned, received.handle)))
    want = hidden * weights.sum(dim=1, keepdim=True)
    if combined.shape != want.shape:
        return float("inf")
    return 0.0 if num_tokens == 0 else ((combined - want).abs().max() / want.abs().max()).item()


def _masked_layout_matches_oracle(group: ParallelInfo, seed: int) -> bool:
    """The low-latency layout against an all-gathered oracle: local expert l's first recv_count[l]
    rows are the tokens (by source rank, then token order) that chose it, the rest are zero."""
    import torch.distributed as dist
    capacity, top_k, width, per_rank = 5, 3, 4, 2
    gen = torch.Generator().manual_seed(seed * 7 + group.ep_rank)
    placement = ExpertPlacement(num_routed=per_rank * group.ep_size, num_fused_shared=0, parallel=group)
    num_tokens = 0 if group.ep_rank == group.ep_size - 1 else 1 + (seed + group.ep_rank) % capacity
    ids = torch.stack([torch.randperm(placement.num_slots, generator=gen)[:top_k] for _ in range(num_tokens)]
                      ) if num_tokens else torch.empty(0, top_k, dtype=torch.long)
    hidden = torch.randn(num_tokens, width, generator=gen)
    dispatcher = DISPATCHERS.build("all_to_all", placement, DispatchConfig(DispatchMode.LOW_LATENCY, capacity))
    route = dispatcher.dispatch_b(dispatcher.dispatch_a(hidden, ids, torch.rand(num_tokens, top_k))).handle.inner
    padded_ids = torch.full((capacity, top_k), -1, dtype=torch.long)
    padded_ids[:num_tokens] = ids
    padded_hidden = torch.zeros(capacity, width)
    padded_hidden[:num_tokens] = hidden
    all_ids = [torch.empty_like(padded_ids) for _ in range(group.ep_size)]
    all_hidden = [torch.empty_like(padded_hidden) for _ in range(group.ep_size)]
    dist.all_gather(all_ids, padded_ids, group=group.group)
    dist.all_gather(all_hidden, padded_hidden, group=group.group)
    ok = route.recv_x.shape == (per_rank, group.ep_size * capacity, width)
    for local in range(per_rank):
        expert = placement.first_local + local
        want = [h[t] for h, i in zip(all_hidden, all_ids) for t in range(capacity) if expert in i[t].tolist()]
        count = int(route.recv_count[local])
        ok = ok and count == len(want) and bool((route.recv_x[local, count:] == 0).all())
        ok = ok and (not want or torch.equal(route.recv_x[local, :count], torch.stack(want)))
    return ok


def _over_capacity_is_refused(group: ParallelInfo) -> bool:
    """Every rank has one token more than the capacity: each refuses before any collective starts
    (so the group stays in step: the next dispatch works)."""
    placement = ExpertPlacement(num_routed=2 * group.ep_size, num_fused_shared=0, parallel=group)
    dispatcher = DISPATCHERS.build("all_to_all", placement, DispatchConfig(DispatchMode.LOW_LATENCY, 3))
    try:
        dispatcher.dispatch_a(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2),
                              ForwardMode.DECODE)
    except UserError as exc:
        return "4 tokens on this rank exceeds the low-latency EP dispatch capacity of 3" in str(exc)
    return False
