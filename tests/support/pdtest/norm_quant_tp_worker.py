"""The body of one gloo rank in tests/model/quant/test_norm_fp8_linear_tp.py (a module of its own so
spawned children import only torch and deepseek_pd, not pytest).

Two ranks, one TP group of 2 with experts spread over it (ep 2: "serve --tp 2"), so every layer
after the first takes scattered rows and its input norm's rows are all-gathered for attention. Each
rank writes to `<dir>/rank<r>.pt`:
    communicator   `LayerCommunicator.prepare_attn` on scattered rows, fused (norm + quantisation,
                   gathered packed) and plain (norm, gathered in the model dtype), and the one-process
                   oracle: the norm of all rows, quantised as the FP8 linear quantises them
    tp2            the TP runner's logits (prefill, two decode steps), and which layers quantised
                   their input
    tp2_unfused    the same TP runner built with no norm fused with its readers' quantisation
                   (`decoder_layer.norm_quant_group` patched, in this child only)
Run on the CPU through Triton's interpreter (TRITON_INTERPRET comes from the parent's environment).
"""
from __future__ import annotations

import datetime
import random
from pathlib import Path
from typing import Any

import torch

from deepseek_pd.model.distributed.layer_communicator import LayerCommunicator
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.distributed.scatter_mode import LayerScatterModes, ScatterMode
from deepseek_pd.model.norm import RMSNorm
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig

GLOO_TIMEOUT = datetime.timedelta(seconds=60)
TP = 2


def _communicator(parallel: ParallelInfo, seed: int) -> dict[str, Any]:
    """prepare_attn on this rank's share of `rows` rows, fused and plain (same norm, same rows)."""
    rng = torch.Generator().manual_seed(seed)
    dim, group, rows = 4 * (8 + seed % 40), 16 * (1 + seed % 3), 5 + seed % 4  # rows: tp need not divide them
    norm = RMSNorm(dim, 1e-6, backend="triton")
    norm.weight.data = 1 + 0.2 * torch.randn(dim, generator=rng)
    hidden_all, residual_all = torch.randn(rows, dim, generator=rng) * 4, torch.randn(rows, dim, generator=rng)
    chunk = -(-rows // TP)
    mine = slice(min(rows, parallel.tp_rank * chunk), min(rows, (parallel.tp_rank + 1) * chunk))
    modes = LayerScatterModes(ScatterMode.SCATTERED, ScatterMode.TP_ATTN_FULL, ScatterMode.SCATTERED,
                              ScatterMode.SCATTERED)
    fused = LayerCommunicator(modes, norm, norm, parallel, attn_quant_group=group)
    plain = LayerCommunicator(modes, norm, norm, parallel)
    rows_q, res_q = fused.prepare_attn(hidden_all[mine], residual_all[mine], rows)
    rows_p, res_p = plain.prepare_attn(hidden_all[mine], residual_all[mine], rows)
    from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant  # what an FP8 linear runs first

    normed_all, _ = norm.add_and_norm(hidden_all, residual_all)  # one process, every row
    want_fp8, want_scale = per_token_group_quant(normed_all, group)
    plain_fp8, plain_scale = per_token_group_quant(rows_p, group)
    return {"quantises": fused.quantises_attn_input, "fp8": rows_q.fp8.view(torch.uint8).clone(),
            "scale": rows_q.scale.clone(), "want_fp8": want_fp8.view(torch.uint8), "want_scale": want_scale,
            "plain_fp8": plain_fp8.view(torch.uint8), "plain_scale": plain_scale,
            "residual": res_q, "want_residual": res_p, "rows": rows}

def _calls(runner: ModelRunner, seed: int, vocab: int) -> dict[str, torch.Tensor]:
    """Prefill of an odd number of rows (shares of unequal size), then two decode steps."""
    rng = random.Random(seed)
    pool = runner.kv_pool
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    if sum(map(len, prompts)) % TP == 0:
        prompts[-1].append(rng.randrange(vocab))
    pages = [pool.alloc(pool.pages_for_tokens(len(p) + 4)) for p in prompts]
    out = {"extend": runner.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)])}
    lengths = [len(p) for p in prompts]
    for step in range(2):  # drawn tokens, not each runner's argmax: a near tie would part the runs
        next_ids = [rng.randrange(vocab) for _ in prompts]
        out[f"decode{step}"] = runner.decode([DecodeSeq(t, n + step, pg) for t, n, pg in zip(next_ids, lengths, pages)])
    return out


def run_rank(rank: int, world: int, port: int, directory: str, seed: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    try:
        parallel = ParallelInfo(world, rank, None, TP, rank, None)
        results: dict[str, Any] = {"communicator": _communicator(parallel, seed)}
        fields = dict(model=str(Path(directory) / "checkpoint"), page_size=4, num_pages=64, fp8_backend="triton",
                      norm_rope_backend="triton", attention_backend="torch")
        tp2 = ModelRunner(RunnerConfig(**fields, ep_size=world, tp_size=TP), parallel=parallel)
        vocab = tp2.model_config.vocab_size
        results["tp2"] = _calls(tp2, seed, vocab)  # the same calls on both ranks of the group
        from deepseek_pd.model import decoder_layer

        fuse = decoder_layer.norm_quant_group
        decoder_layer.norm_quant_group = lambda norm, linears: None
        try:
            unfused = ModelRunner(RunnerConfig(**fields, ep_size=world, tp_size=TP), parallel=parallel)
        finally:
            decoder_layer.norm_quant_group = fuse
        assert not any(layer.comm.quantises_attn_input for layer in unfused.model.layers)
        results["tp2_unfused"] = _calls(unfused, seed, vocab)
        results["quantised_layers"] = [layer.comm.quantises_attn_input for layer in tp2.model.layers]
        results["scattered_inputs"] = [LayerScatterModes.for_layer(tp2.model_config, i, parallel).layer_input
                                       is ScatterMode.SCATTERED for i in range(len(tp2.model.layers))]
        torch.save(results, Path(directory) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
