"""The input norm fused with FP8 quantisation under attention TP, over gloo on the CPU (Triton's
interpreter): where a layer's input rows are scattered over the TP ranks, each rank normalises and
quantises its share in one launch and the ranks all-gather the quantised rows packed (fp8 bytes +
scales, about half the bytes of the model-dtype rows).

- `LayerCommunicator.prepare_attn`, fused, gives on every rank the bytes one process computes (the
  norm of all rows, then the FP8 linear's own quantisation), and those of the plain TP path, at a
  row count tp does not divide;
- a tiny FP8 model at tp 2 with experts over both ranks ("serve --tp 2"), every layer's input norm
  fused, gives the logits of the same TP model unfused, bit for bit (prefill and decode).
  TP against one process for the unfused path is test_attention_tp's (fp32, 1e-5). With FP8
  activations that comparison is not continuous: o_proj's partial sums, added in another order,
  move a value across an e4m3 rounding step and then a router's top-k (measured, 4 seeds: 4e-2 to
  0.39 of the largest logit, with and without the fusion alike).
One `torch.multiprocessing.spawn` of 2 ranks (`norm_quant_tp_worker.run_rank`).
"""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import HAS_CUDA, needs_triton  # first: it sets TRITON_INTERPRET for the children too

from deepseek_pd.model.checkpoint.tiny import make_tiny_model  # noqa: E402
from deepseek_pd.ports import pick_free_ports  # noqa: E402

from pdtest.norm_quant_tp_worker import run_rank  # noqa: E402

WORLD = 2


@needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="a CPU run: Triton's interpreter on every rank")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_input_norm_fused_under_tp_gives_the_one_process_rows_and_the_unfused_logits(tmp_path):
    seed = random.randrange(1 << 20)
    make_tiny_model(tmp_path / "checkpoint", arch=random.choice(["v2", "v3"]), seed=seed, fp8_block=(128, 128))
    torch.multiprocessing.spawn(run_rank, args=(WORLD, pick_free_ports(1)[0], str(tmp_path), seed), nprocs=WORLD,
                                join=True)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        comm = results["communicator"]
        assert comm["quantises"] and comm["fp8"].shape[0] == comm["rows"]
        assert torch.equal(comm["fp8"], comm["want_fp8"]), f"seed {seed} rank {rank}: fp8 bytes differ"
        assert torch.equal(comm["scale"], comm["want_scale"]) and torch.equal(comm["residual"], comm["want_residual"])
        assert torch.equal(comm["fp8"], comm["plain_fp8"]) and torch.equal(comm["scale"], comm["plain_scale"])
        # Every layer whose input arrives scattered is fused too (before: only the unmoved ones).
        assert any(results["scattered_inputs"]) and all(results["quantised_layers"]), results
        for case, got in results["tp2"].items():
            assert torch.equal(got, results["tp2_unfused"][case]), f"seed {seed} rank {rank} {case}"
