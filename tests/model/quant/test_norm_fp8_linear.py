"""`NormThenLinear`: the fused norm + FP8 quantisation then the GEMM gives the bytes of
`linear(norm(x))`, at random odd widths and block sizes; it is what MLA's q_a_layernorm -> q_b_proj
runs with the Triton norm and FP8 backends, and the plain composition otherwise. On the CPU through
Triton's interpreter."""
from __future__ import annotations

import random

import pytest
import torch

from pdtest.triton_env import DEVICE, HAS_CUDA, needs_triton  # noqa: E402 (first: it sets TRITON_INTERPRET)

from deepseek_pd.model.build_options import BuildOptions  # noqa: E402
from deepseek_pd.model.config import ModelConfig  # noqa: E402
from deepseek_pd.model.checkpoint.tiny import tiny_config  # noqa: E402
from deepseek_pd.model.deepseek import DeepseekForCausalLM  # noqa: E402
from deepseek_pd.model.norm import RMSNorm  # noqa: E402
from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig, quantize_block_fp8  # noqa: E402
from deepseek_pd.model.quant.fp8_linear import Fp8Linear  # noqa: E402
from deepseek_pd.model.quant.norm_fp8_linear import NormThenLinear  # noqa: E402


def _layers(dim: int, out: int, block: Fp8BlockQuantConfig, dtype: torch.dtype, norm_backend: str,
            gemm_backend: str) -> tuple[RMSNorm, Fp8Linear]:
    norm = RMSNorm(dim, 1e-6, dtype=dtype, device=DEVICE, backend=norm_backend)
    norm.weight.data = (1 + 0.2 * torch.randn(dim)).to(dtype).to(DEVICE)
    linear = Fp8Linear(dim, out, block, gemm_backend, DEVICE)
    w_fp8, w_scale = quantize_block_fp8(torch.randn(out, dim) * 0.05, block)
    linear.weight.data, linear.weight_scale_inv.data = w_fp8.to(DEVICE), w_scale.to(DEVICE)
    return norm, linear


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_norm_then_fp8_linear_is_bit_for_bit_the_unfused_pair(dtype):
    for _ in range(2):
        block = Fp8BlockQuantConfig(*random.choice([(128, 128), (32, 32), (48, 16)]))
        dim = random.choice([2 * random.randint(20, 150) + 1, block.block_in * random.randint(1, 4)])
        out = random.randint(1, 200)
        norm, linear = _layers(dim, out, block, dtype, "triton", "triton")
        fused = NormThenLinear(norm, linear)
        assert fused.fused
        tokens = random.randint(1, 7)
        # A column slice (a row stride past its width), as q_a out of the fused q_a + kv_a projection.
        x = (torch.randn(tokens, 2, dim + 5) * 10).to(dtype).to(DEVICE)[:, 1, :dim]
        got = fused(x)
        want = linear(norm(x))
        assert got.dtype == want.dtype and got.shape == want.shape == (tokens, out)
        if HAS_CUDA and dtype == torch.float32:
            # fp32 rows on a GPU: the fused and the plain norm reduce the row in different orders
            # (tests/model/kernels/test_rmsnorm_quant.py says why; H100, 2026-12-07), so the
            # activation scales differ in their last bits; 16-bit rows are bit for bit.
            assert (got - want).abs().max() <= 1e-2 * want.abs().max(), (dim, out, block)
        else:
            assert torch.equal(got, want), (dim, out, block)


@needs_triton
@pytest.mark.parametrize("norm_backend,gemm_backend", [("torch", "triton"), ("triton", "torch"), ("torch", "torch")])
def test_without_both_triton_backends_it_is_the_plain_composition(norm_backend, gemm_backend):
    block = Fp8BlockQuantConfig(32, 32)
    dim, out = random.choice([64, 77]), random.randint(1, 50)
    norm, linear = _layers(dim, out, block, torch.float32, norm_backend, gemm_backend)
    composed = NormThenLinear(norm, linear)
    assert not composed.fused
    x = torch.randn(random.randint(1, 5), dim).to(DEVICE)
    assert torch.equal(composed(x), linear(norm(x)))
    plain = torch.nn.Linear(dim, out, bias=False).to(DEVICE)
    assert not NormThenLinear(norm, plain).fused


@needs_triton
@pytest.mark.parametrize("backends,fused", [(dict(fp8_backend="triton", norm_rope_backend="triton"), True),
                                            (dict(fp8_backend="triton", norm_rope_backend="torch"), False),
                                            (dict(fp8_backend=None, norm_rope_backend="triton"), False)])
def test_mla_runs_q_a_norm_and_q_b_proj_fused_with_the_triton_fp8_backends(backends, fused):
    config = ModelConfig.from_hf({**tiny_config("v3", 512), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    model = DeepseekForCausalLM(config, BuildOptions(device=DEVICE, **backends))
    layers = [layer.self_attn for layer in model.layers]
    assert layers and all(attn._q_b_of_q_a.fused == fused for attn in layers)
    assert all(attn._q_b_of_q_a.linear is attn.q_b_proj and attn._q_b_of_q_a.norm is attn.q_a_layernorm
               for attn in layers)
    # The post-attention norm -> a dense MLP's gate_up_proj: the same rule (norm_rope_backend=torch unfuses).
    assert [layer.comm.quantises_mlp_input for layer in model.layers] == \
        [fused and not layer.is_moe for layer in model.layers]


@needs_triton
def test_a_model_with_its_norms_fused_gives_the_logits_of_the_unfused_model_bit_for_bit(tmp_path, monkeypatch):
    """A tiny FP8 checkpoint, Triton norms and FP8 GEMMs: the input norm hands attention quantised
    rows (and q_a_layernorm q_b_proj's, the dense layer's post-attention norm its gate_up_proj's);
    prefill logits equal those of the same model built with every norm unfused."""
    from deepseek_pd.model import decoder_layer
    from deepseek_pd.model.attention import mla
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model
    from deepseek_pd.model.runner import ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    directory = make_tiny_model(tmp_path / "m", arch=random.choice(["v2", "v3"]), seed=random.randint(0, 10_000),
                                fp8_block=(128, 128))
    prompt = [random.randrange(1, 100) for _ in range(random.randint(3, 24))]

    def prefill() -> tuple[ModelRunner, torch.Tensor]:
        runner = ModelRunner(RunnerConfig(model=str(directory), device=DEVICE, num_pages=16, fp8_backend="triton",
                                          norm_rope_backend="triton"))
        pages = list(range(-(-len(prompt) // runner.config.page_size)))
        return runner, runner.extend([ExtendSeq(prompt, 0, pages)])

    fused_runner, fused = prefill()
    assert all(layer.comm.quantises_attn_input for layer in fused_runner.model.layers)
    # The dense layer's MLP takes quantised rows; a MoE layer's router needs them in the model dtype.
    assert [layer.comm.quantises_mlp_input for layer in fused_runner.model.layers] == \
        [not layer.is_moe for layer in fused_runner.model.layers]
    monkeypatch.setattr(decoder_layer, "norm_quant_group", lambda norm, linears: None)
    monkeypatch.setattr(mla.NormThenLinear, "__init__", _unfused_init)
    plain_runner, plain = prefill()
    assert not any(layer.comm.quantises_attn_input or layer.comm.quantises_mlp_input
                   for layer in plain_runner.model.layers)
    assert torch.equal(fused, plain)


def _unfused_init(self, norm, linear) -> None:
    self.norm, self.linear, self.group = norm, linear, None
