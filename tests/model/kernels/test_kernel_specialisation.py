"""No step kernel compiles a new variant because a batch's size changed (model/kernels/__init__.py).

Triton compiles a kernel once per class of each plain int argument: 1 (a constant), divisible by
16, or neither (and i32 or i64 by range). An argument that is `do_not_specialize` is one class.
On the GPU a new variant mid-serving is a compile and a module load, and the load waits for the
whole device (tests/workers/prefill/test_chunk_send_order_cuda.py's stall).

CPU: every launched Triton kernel of the step path (each `@triton.jit` in model/kernels/ and the
KV cipher's) is found by reading its module, its launch replaced by a recorder (nothing runs: the
tensors are on the meta device), and its wrapper called the way the backends call it, at many
random batch sizes (1, multiples of 16 and others, up to ~300 tokens or sequences) for the tiny
model's shape and for V2-Lite's and V3's. The oracle is Triton's own rule above applied to the
recorded arguments: an int argument whose class changes with the batch must be unspecialised.
A kernel the scenarios never launch fails the test too, so a new kernel must be added here.
Failed before: 17 arguments of 10 kernels (num_pairs, num_blocks, M, num_splits, the
page table's width and the split lse strides) changed class with the batch.

GPU (skipped on CPU): the tiny model on CUDA with the Triton backends, warmed up as a worker
warms it (workers/engine/model_warm_up.py), then extends and decodes at random sizes: Triton's
compile hook must not fire.
"""
from __future__ import annotations

import importlib
import inspect
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pdtest.triton_env import HAS_TRITON  # noqa: I001 (first: it sets TRITON_INTERPRET before any kernel import)

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package"), pytest.mark.timeout(120)]

_ROOT = Path(__file__).resolve().parents[3]
_STEP_KERNEL_FILES = sorted((_ROOT / "model" / "kernels").glob("*.py")) + [
    _ROOT / "workers" / "transport" / "kv_cipher_kernel.py"]
META = torch.device("meta")


@dataclass(frozen=True)
class Shape:
    """The dims the kernels see (per rank): routed + fused shared experts, top-k + shared."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    heads: int
    rank: int
    rope: int
    nope: int
    v_dim: int
    page_size: int


SHAPES = [Shape("tiny", 64, 32, 9, 3, 4, 32, 16, 32, 16, 4),
          Shape("v2-lite", 2048, 1408, 66, 8, 16, 512, 64, 128, 128, 64),
          Shape("v3", 7168, 2048, 257, 9, 128, 512, 64, 128, 128, 64)]


def _module_name(path: Path) -> str:
    rel = path.relative_to(_ROOT).with_suffix("")
    return "deepseek_pd." + ".".join(rel.parts)


def launched_kernels() -> dict[str, object]:
    """`module:name` → every `@triton.jit` function its module launches (`name[grid](...)`)."""
    from triton.runtime.jit import KernelInterface

    found = {}
    for path in _STEP_KERNEL_FILES:
        source = path.read_text()
        if "@triton.jit" not in source:
            continue
        module = importlib.import_module(_module_name(path))
        for name, value in vars(module).items():
            if isinstance(value, KernelInterface) and re.search(rf"\b{re.escape(name)}\[", source):
                found[f"{path.stem}:{name}"] = value
    return found


def unspecialised(kernel) -> set[str]:
    """The kernel's `do_not_specialize` parameters by name (a JITFunction, or the interpreter's)."""
    names = list(inspect.signature(kernel.fn).parameters)
    listed = getattr(kernel, "do_not_specialize", None)
    if listed is None:
        listed = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    return {names[x] if isinstance(x, int) else x for x in listed}


def int_class(value: int) -> str:
    """Triton's specialisation of a plain int (python/src/specialize.cc, handle_long_type)."""
    if value == 1:
        return "constant 1"
    width = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    return f"{width}, divisible by 16" if value % 16 == 0 else width


class Recorder:
    """Each launch's plain arguments by kernel; the launch itself does nothing."""

    def __init__(self, kernels: dict[str, object], monkeypatch) -> None:
        self.calls: dict[str, list[dict]] = {name: [] for name in kernels}
        # The wrappers take CPU or meta tensors only when Triton interprets (checks.py); nothing runs
        # here, so the same holds on a machine with CUDA (there the variable is unset).
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        for name, kernel in kernels.items():
            monkeypatch.setattr(kernel, "run", self._recorder(name, kernel))

    def _recorder(self, name: str, kernel):
        signature = inspect.signature(kernel.fn)

        def run(*args, grid, warmup, **kwargs):
            params = {k: v for k, v in kwargs.items() if k in signature.parameters}
            bound = signature.bind(*args, **params)
            constexpr = {p for p, spec in signature.parameters.items() if "constexpr" in str(spec.annotation)}
            self.calls[name].append({p: v for p, v in bound.arguments.items() if p not in constexpr}
                                    | {_SITE: _call_site()})
        return run

    def changing_classes(self, kernels: dict[str, object]) -> list[str]:
        """`kernel.param: classes` for each specialised int whose class changed between launches."""
        bad = set()
        for name, calls in self.calls.items():
            skip = unspecialised(kernels[name])
            for site in {c[_SITE] for c in calls}:
                at_site = [c for c in calls if c[_SITE] == site]
                for param in set(at_site[0]) - {_SITE} - skip:
                    values = [c[param] for c in at_site if type(c[param]) is int]
                    classes = sorted({int_class(v) for v in values})
                    if len(classes) > 1:
                        bad.add(f"{name}.{param}: {classes} (e.g. {sorted(set(values))[:6]}; {site})")
        return sorted(bad)


_SITE = "call site"


def _call_site() -> str:
    """The line of `run_step_kernels` that led to a launch: one call site's variants are the
    batch's; different call sites (a kernel used for two weights) are a fixed set of variants."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != run_step_kernels.__name__:
        frame = frame.f_back
    return f"line {frame.f_lineno}" if frame is not None else "outside the scenarios"


def _rand(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def _split(total: int, rng: random.Random) -> list[int]:
    """`total` tokens as a random number of sequences (each >= 1)."""
    cuts = sorted(rng.sample(range(1, total), min(total - 1, rng.randint(0, 7)))) if total > 1 else []
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def run_step_kernels(s: Shape, n: int, rng: random.Random) -> None:
    """The step kernels' wrappers at `n` tokens (or `n` decode sequences), shaped as the backends
    call them (model/attention/triton_backend.py, mla.py, model/moe/triton_experts.py)."""
    from deepseek_pd.model.kernels.flash_prefill import flash_attention
    from deepseek_pd.model.kernels.fp8_gemm import block_fp8_matmul
    from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
    from deepseek_pd.model.kernels.fused_moe import fused_moe
    from deepseek_pd.model.kernels.matmul_invariant import matmul_invariant
    from deepseek_pd.model.kernels.merge_states import merge_states
    from deepseek_pd.model.kernels.mla_decode import INVARIANT_DECODE_TILE, MLADecodeTile, mla_decode
    from deepseek_pd.model.kernels.moe_single_token import MAX_TOKENS, fused_moe_single_token
    from deepseek_pd.model.kernels.rmsnorm import rms_norm
    from deepseek_pd.model.kernels.rmsnorm_quant import rms_norm_quant
    from deepseek_pd.model.kernels.rope_cache import rope_and_cache_write
    from deepseek_pd.model.kernels.router_select import router_select
    from deepseek_pd.model.quant.fp8_ops import FP8_DTYPE
    from deepseek_pd.workers.transport.kv_cipher_kernel import chacha20_copy_rows

    i32 = torch.int32
    hidden = _rand(n, s.hidden)
    for invariant in (False, True):
        fused_moe(hidden, _rand(n, s.top_k, dtype=i32), _rand(n, s.top_k, dtype=torch.float32),
                  _rand(s.experts, 2 * s.inter, s.hidden), _rand(s.experts, s.hidden, s.inter), invariant=invariant)
    if n <= MAX_TOKENS:  # FusedExperts' one-token path (moe/experts.py)
        fused_moe_single_token(hidden, _rand(n, s.top_k, dtype=torch.long), _rand(n, s.top_k, dtype=torch.float32),
                               _rand(s.experts, 2 * s.inter, s.hidden), _rand(s.experts, s.hidden, s.inter))
    router_select(_rand(n, s.experts, dtype=torch.float32), _rand(s.experts, dtype=torch.float32), "noaux_tc",
                  "sigmoid", s.top_k, 1, 1, True, 2.5, 1, s.experts)
    rms_norm(hidden, _rand(s.hidden), 1e-6, residual=_rand(n, s.hidden))
    rms_norm_quant(hidden, _rand(s.hidden), 1e-6, 128, residual=_rand(n, s.hidden))
    x_fp8, x_scale = per_token_group_quant(hidden, 128)
    groups = -(-s.hidden // 128)
    block_fp8_matmul(x_fp8, x_scale, _rand(s.inter, s.hidden, dtype=FP8_DTYPE),
                     _rand(-(-s.inter // 128), groups, dtype=torch.float32), 128, 128, torch.bfloat16)
    # Attention: q [T, H, nope + rope] and the latent [T, rank + rope] as the projections give them.
    qk = s.nope + s.rope
    q = _rand(n, s.heads, qk)
    latent = _rand(n, s.rank + s.rope)
    cache = _rand(64 * s.page_size, s.rank + s.rope)
    rope_and_cache_write(q[..., s.nope:], latent[:, s.rank:], latent[:, :s.rank], _rand(n, dtype=torch.long),
                         _rand(s.rope // 2, dtype=torch.float32), 1.0, False, cache, _rand(n, dtype=torch.long))
    lens = _split(n, rng)
    offsets = _rand(len(lens) + 1, dtype=i32)
    k_nope, v = _rand(n, s.heads, s.nope), _rand(n, s.heads, s.v_dim)
    out, lse = flash_attention(q[..., :s.nope], k_nope, v, offsets, offsets, max(lens), 0.1, causal=True,
                               q_rope=q[..., s.nope:], k_rope=latent[:, s.rank:])
    prefix = rng.randint(1, 300)
    flash_attention(q[..., :s.nope], _rand(prefix, s.heads, s.nope), _rand(prefix, s.heads, s.v_dim), offsets,
                    _rand(len(lens) + 1, dtype=i32), max(lens), 0.1, causal=False, q_rope=q[..., s.nope:],
                    k_rope=_rand(prefix, s.rope))
    merge_states(out, lse, out, lse)
    # Absorbed MLA (mla.py): the latent query is a bmm's output transposed back to [T, H, R].
    q_latent = _rand(s.heads, n, s.rank).transpose(0, 1)
    max_len = rng.randint(1, 5000)
    width = -(-max_len // s.page_size)
    paged = cache.view(64, s.page_size, -1)
    for tile in (MLADecodeTile(), INVARIANT_DECODE_TILE):
        mla_decode(q_latent, q[..., s.nope:], paged, _rand(n, width, dtype=i32), _rand(n, dtype=i32), max_len, 0.1,
                   tile=tile)
    matmul_invariant(q[..., :s.nope].transpose(0, 1), _rand(s.heads, s.nope, s.rank))
    matmul_invariant(hidden.unsqueeze(0), _rand(s.inter, s.hidden).t().unsqueeze(0))
    # The KV cipher over a send's pages (`n` rows), from some page of some layer.
    kv = _rand(64, s.page_size, s.rank + s.rope)
    chacha20_copy_rows(kv, _rand(n, dtype=torch.long), kv, _rand(n, dtype=torch.long), _rand(8, dtype=i32),
                       rng.randrange(61), rng.randrange(1000))


def batch_sizes(rng: random.Random) -> list[int]:
    """1, some multiples of 16 and some other sizes up to ~300."""
    return [1, 2, 16 * rng.randint(1, 18), 16 * rng.randint(1, 18)] + rng.sample(range(3, 300), 8)


def test_no_step_kernel_argument_changes_its_specialisation_with_the_batch(monkeypatch):
    rng = random.Random(random.getrandbits(32))  # the run's seed (pdtest/seeding.py)
    kernels = launched_kernels()
    assert len(kernels) >= 15, sorted(kernels)  # the discovery found the step kernels
    bad = []
    for shape in SHAPES:
        recorder = Recorder(kernels, monkeypatch)
        for n in batch_sizes(rng):
            run_step_kernels(shape, n, rng)
        never = sorted(name for name, calls in recorder.calls.items() if not calls)
        assert not never, f"step kernels no scenario launches (add them to run_step_kernels): {never}"
        bad += [f"{shape.name}: {line}" for line in recorder.changing_classes(kernels)]
    assert not bad, ("int arguments whose Triton specialisation changes with the batch (make them "
                     "do_not_specialize in the kernel's decorator):\n  " + "\n  ".join(bad))


def test_the_class_rule_and_the_recorder_see_what_triton_sees(monkeypatch):
    """The oracle itself: Triton's classes of 1, 16 and 17, and a kernel without the marking flagged."""
    from deepseek_pd.model.kernels import moe_align_small

    assert len({int_class(1), int_class(16), int_class(17), int_class(2 ** 31)}) == 4
    kernels = {"moe_align_small:_align_small_kernel": moe_align_small._align_small_kernel}
    monkeypatch.setattr(moe_align_small._align_small_kernel, "do_not_specialize", [], raising=False)
    monkeypatch.setattr(moe_align_small._align_small_kernel, "kwargs", {}, raising=False)
    recorder = Recorder(kernels, monkeypatch)
    for pairs in (1, 3, 16):
        moe_align_small.align_by_expert_small(_rand(pairs, 1, dtype=torch.int32), 8, 16)
    assert {line.split(":")[1].split(".")[1] for line in recorder.changing_classes(kernels)} >= {"num_pairs",
                                                                                                 "num_blocks"}


@pytest.mark.gpu
@pytest.mark.timeout(600)  # a cold Triton cache compiles every warmed variant first
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_a_warmed_engine_compiles_no_kernel_at_new_batch_sizes(cuda_graph):
    """The tiny model on CUDA with the Triton backends (bf16), warmed as a worker warms it (the
    model warm-up's extends, and with `graphs` the decode graphs' capture), then extends without
    and with a prefix and decodes at random sizes: Triton's compile hook must not fire (a compile
    is a new variant, whose first launch loads a module)."""
    import triton

    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.sampling.sampler import Sampler
    from deepseek_pd.workers.engine import model_warm_up
    from deepseek_pd.workers.engine.prefill_round import PrefillRounds

    rng = random.Random(random.getrandbits(32))
    runner = ModelRunner(RunnerConfig(model="tiny", page_size=16, num_pages=512, device="cuda", dtype="bfloat16",
                                      attention_backend="triton", moe_backend="triton", cuda_graph=cuda_graph))
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    assert model_warm_up.warm_up(PrefillRounds(runner, Sampler(), 512, hooks=None)) > 0
    torch.cuda.synchronize()
    compiled: list[str] = []
    runtime = triton.knobs.runtime
    before = runtime.jit_cache_hook

    def record(*, repr, compile, **_):  # called on each in-process cache miss, before the compile
        compiled.append(f"{repr} constants {compile.get('constants')}")
        return False  # compile as usual
    runtime.jit_cache_hook = record
    try:
        sizes = [1, 2, 16, 32, 48] + rng.sample(range(3, 300), 10)
        for n in rng.sample(sizes, len(sizes)):
            prompt = [rng.randrange(2, vocab) for _ in range(n + rng.randint(1, 40))]
            pages = pool.alloc(pool.pages_for_tokens(len(prompt) + 1))
            try:
                runner.extend([ExtendSeq(prompt[:n], 0, pages)])  # no prefix: MHA
                runner.extend([ExtendSeq(prompt[n:], n, pages)])  # over the cached prefix
                batch = rng.choice([1, 2, rng.randint(3, 40)])
                runner.decode([DecodeSeq(rng.randrange(2, vocab), len(prompt), pages)] * batch)
            finally:
                pool.free(pages[::-1])
        torch.cuda.synchronize()
    finally:
        runtime.jit_cache_hook = before
    assert not compiled, (f"{len(compiled)} Triton kernels compiled after the warm-up (each a module load "
                          f"mid-serving):\n  " + "\n  ".join(compiled))
