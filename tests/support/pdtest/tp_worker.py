"""The body of one gloo rank in `test_attention_tp.py` (a module of its own so spawned children
import only torch and deepseek_pd, not pytest or transformers).

World 4, ranks of one DP group consecutive: TP groups {0, 1} and {2, 3} (DP groups 0 and 1).
Each rank builds the world-size-1 reference and three TP variants from the same checkpoint:
    tp2          attention TP 2 over its pair, experts replicated (ep 1, `local`)
    tp2_ep2      TP 2 over its pair, experts spread over the same pair (ep 2): "serve --tp 2"
    tp2_dp2_ep4  TP 2 x DP 2, experts spread over all 4 ranks (built through RunnerConfig from
                 the checkpoint directory, as a worker builds it)
Both ranks of a TP group run their DP group's tokens (seeded by the DP rank); every variant is
driven through the same calls: extend (MHA), extend with a cached prefix (MHA_CHUNKED_KV),
an absorbed-MLA extend, decode (MLA), a step where DP group 0 decodes one sequence (rows not
divisible by tp), and one where DP group 1 is idle (`runner.idle()`); the first two extends have
an odd row count. Logits go to `<dir>/rank<r>.pt`, with the rows each dense
layer's MLP ran on in each forward (`dense_rows`); the parent compares each variant with the
reference, and the dense rows with this TP rank's share of the reference's.
"""
from __future__ import annotations

import datetime
import random
from pathlib import Path
from typing import Any

import torch

from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig

GLOO_TIMEOUT = datetime.timedelta(seconds=60)
TP = 2
VARIANTS = ("tp2", "tp2_ep2", "tp2_dp2_ep4")
RUNNER = RunnerConfig(model="<in-memory>", page_size=4, num_pages=128, mha_chunked_kv_threshold=4)


def _scenario(runner: ModelRunner, dp_rank: int, seed: int, vocab: int) -> dict[str, torch.Tensor]:
    """The same call sequence on every rank; the same tokens on the ranks of one DP group."""
    rng = random.Random(seed * 1000 + dp_rank)
    pool = runner.kv_pool
    num_seqs = 2 + (dp_rank + seed) % 2
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(num_seqs)]
    more = [[rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for _ in range(num_seqs)]
    for batch in (prompts, more):  # an odd row count: the TP ranks' shares differ
        if sum(map(len, batch)) % TP == 0:
            batch[-1].append(rng.randrange(vocab))
    pages = [pool.alloc(pool.pages_for_tokens(len(p) + 2 * len(m) + 4)) for p, m in zip(prompts, more)]
    out = {"extend_mha": runner.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)])}
    out["extend_chunked_kv"] = runner.extend([ExtendSeq(m, len(p), pg) for p, m, pg in zip(prompts, more, pages)])
    lengths = [len(p) + len(m) for p, m in zip(prompts, more)]
    # A short prefix on one sequence only (sum below the threshold): the absorbed MLA extend.
    out["extend_mla"] = runner.extend([ExtendSeq(more[0], lengths[0], pages[0])])
    lengths[0] += len(more[0])
    next_ids = out["extend_chunked_kv"].argmax(-1).tolist()
    for step in range(2):
        logits = runner.decode([DecodeSeq(t, n + step, pg) for t, n, pg in zip(next_ids, lengths, pages)])
        out[f"decode{step}"] = logits
        next_ids = logits.argmax(-1).tolist()
    active = 1 if dp_rank == 0 else num_seqs  # one row on a TP group of 2: rank 1 dispatches nothing
    out["decode_uneven"] = runner.decode(
        [DecodeSeq(t, n + 2, pg) for t, n, pg in list(zip(next_ids, lengths, pages))[:active]])
    if dp_rank == 1:  # the whole DP group is idle this step; the other's all-to-alls still need it
        runner.idle(ForwardMode.DECODE)
        out["decode_dp_group_idle"] = torch.empty(0)
    else:
        out["decode_dp_group_idle"] = runner.decode(
            [DecodeSeq(t, n + 2, pg) for t, n, pg in zip(next_ids, lengths, pages)])
    return out


def _count_dense_rows(runner: ModelRunner) -> list[int]:
    """Records the rows each dense layer's MLP runs on, forward by forward, into the list returned."""
    rows: list[int] = []
    for layer in runner.model.layers:
        if not layer.is_moe:
            layer.mlp.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    return rows


def _model(config: ModelConfig, weights: dict[str, torch.Tensor], parallel: ParallelInfo,
           dispatcher: str) -> ModelRunner:
    model = DeepseekForCausalLM(config, BuildOptions(dispatcher=dispatcher, parallel=parallel, prefix_chunk_size=3))
    model.load_weights(weights.items())
    return ModelRunner.from_model(model.eval(), RUNNER)


def run_rank(rank: int, world: int, port: int, directory: str, seed: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    try:
        pairs = [dist.new_group(list(range(d * TP, (d + 1) * TP))) for d in range(world // TP)]  # every rank, in order
        dp_rank, tp_rank = divmod(rank, TP)
        pair = pairs[dp_rank]
        saved: dict[str, Any] = torch.load(Path(directory) / "model.pt")
        config = ModelConfig.from_hf(saved["config"])
        weights = saved["state"]
        runners = {
            "reference": _model(config, weights, ParallelInfo(), "local"),
            "tp2": _model(config, weights, ParallelInfo(tp_size=TP, tp_rank=tp_rank, tp_group=pair), "local"),
            "tp2_ep2": _model(config, weights, ParallelInfo(TP, tp_rank, pair, TP, tp_rank, pair), "all_to_all"),
            "tp2_dp2_ep4": ModelRunner(
                RunnerConfig(model=str(Path(directory) / "checkpoint"), page_size=4, num_pages=128,
                             mha_chunked_kv_threshold=4, prefix_chunk_size=3, ep_size=world, tp_size=TP),
                parallel=ParallelInfo(world, rank, None, TP, tp_rank, pair)),
        }
        dense_rows = {name: _count_dense_rows(runner) for name, runner in runners.items()}
        results: dict[str, Any] = {name: _scenario(runner, dp_rank, seed, config.vocab_size)
                                   for name, runner in runners.items()}
        results["dense_rows"] = dense_rows
        results["local_heads"] = {name: r.model.layers[0].self_attn.num_heads for name, r in runners.items()}
        torch.save(results, Path(directory) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
