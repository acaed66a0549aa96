"""Attention TP weight slicing: each TP rank's MLA weights are its heads' slice of the unsplit ones.

Oracle: the same checkpoint loaded at tp 1 (bf16/fp32: the parameters; FP8 kept in FP8: each
parameter dequantised with its own scales). Loading needs no process group (`ParallelInfo` with
tp_size 2 and a rank), so this runs in one process. Plus the clear errors of bad head splits.
"""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.build_options import BuildOptions
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.deepseek import DeepseekForCausalLM
from deepseek_pd.model.quant.fp8_linear import fp8_blocks
from deepseek_pd.model.quant.fp8_ops import dequant_weight
from deepseek_pd.model.checkpoint.loader import iter_checkpoint_tensors
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.checkpoint.tiny import make_tiny_model

TP = 2


def _load(directory, config, parallel: ParallelInfo, fp8: bool, dtype: torch.dtype) -> DeepseekForCausalLM:
    model = DeepseekForCausalLM(config, BuildOptions(dtype=dtype, parallel=parallel,
                                                     fp8_backend="torch" if fp8 else None))
    model.load_weights(iter_checkpoint_tensors(directory, config, progress=False, keep_fp8=fp8))
    return model.eval()


def _values(model: DeepseekForCausalLM) -> dict[str, torch.Tensor]:
    """Every parameter's real value (FP8 ones dequantised with their own, possibly finer, scales)."""
    params, blocks = dict(model.named_parameters()), fp8_blocks(model)
    out = {}
    for name, param in params.items():
        if name.endswith("_scale_inv"):
            continue
        block = blocks.get(name)
        out[name] = (param.float() if block is None else
                     dequant_weight(param, params[name + "_scale_inv"], block.block_out, block.block_in))
    return out


@pytest.mark.parametrize("arch, fp8_block, dtype", [
    ("v3", None, torch.bfloat16), ("v2", None, torch.float32), ("v3", (128, 128), torch.bfloat16),
    ("v2", (32, 16), torch.float32),
], ids=["v3-bf16", "v2-fp32", "v3-fp8-128", "v2-fp8-32x16"])
def test_tp_rank_weights_are_head_slices_of_the_unsplit_weights(tmp_path, arch, fp8_block, dtype):
    directory = make_tiny_model(tmp_path / arch, arch=arch, seed=random.randrange(10_000), fp8_block=fp8_block)
    config = ModelConfig.from_hf(directory / "config.json")
    fp8 = fp8_block is not None
    full = _values(_load(directory, config, ParallelInfo(), fp8, dtype))
    heads, per = config.num_attention_heads, config.num_attention_heads // TP
    qk, v = config.qk_head_dim, config.v_head_dim
    for rank in range(TP):
        got = _values(_load(directory, config, ParallelInfo(tp_size=TP, tp_rank=rank), fp8, dtype))
        assert got.keys() == full.keys()
        h = slice(rank * per, (rank + 1) * per)
        for name, want in full.items():
            if name.endswith(("q_b_proj.weight", "q_proj.weight")):
                want = want.view(heads, qk, -1)[h].reshape(per * qk, -1)
            elif name.endswith(("w_kc", "w_vc")):
                want = want[h]
            elif name.endswith("o_proj.weight"):
                want = want.view(want.shape[0], heads, v)[:, h].reshape(want.shape[0], per * v)
            assert torch.equal(got[name], want), f"tp rank {rank}: {name} is not its heads' slice"
        sliced = [n for n in got if "self_attn" in n and got[n].shape != full[n].shape]
        assert len(sliced) == 4 * config.num_hidden_layers, sorted(sliced)  # q, w_kc, w_vc, o per layer


def test_tp_that_does_not_divide_the_heads_is_a_user_error(tmp_path):
    directory = make_tiny_model(tmp_path / "tiny", seed=1)
    config = ModelConfig.from_hf(directory / "config.json")
    with pytest.raises(UserError, match="does not divide num_attention_heads"):
        DeepseekForCausalLM(config, BuildOptions(parallel=ParallelInfo(tp_size=3, tp_rank=0)))


def test_runner_config_refuses_tp_with_tbo_and_cuda_graphs():
    with pytest.raises(UserError, match="two-batch overlap"):
        RunnerConfig(tp_size=2, enable_tbo=True)
    assert "attention TP" in RunnerConfig(tp_size=2, device="cuda").cuda_graph_blocker()
    with pytest.raises(UserError, match="tp_size=2 but the TP group"):
        RunnerConfig(tp_size=2).parallel_info(ParallelInfo())
