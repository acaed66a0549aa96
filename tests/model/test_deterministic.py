"""`--deterministic` on the CPU reference: a row's logits do not depend on the rest of the batch.

Oracle: the same runner with the row alone (its own batch). Without the flag the CPU path is
batch-variant in fp32 (BLAS picks gemv for one row, gemm for many; SIMD-tail transcendentals),
which is what makes the flag's check meaningful; this build's bf16 CPU path happened to give equal
bits (docs/deterministic.md).
"""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.prefill_planner import PromptProgress, plan_extend_batch
from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig

pytestmark = [pytest.mark.timeout(300)]


def _rows_vs_alone(runner: ModelRunner, rng: random.Random, rows: int) -> tuple[list[bool], list[bool]]:
    vocab = runner.model_config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 30))] for _ in range(rows)]
    pages = [runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(p) + 1)) for p in prompts]
    alone = [runner.extend([ExtendSeq(p, 0, pg)])[0] for p, pg in zip(prompts, pages)]
    batch = runner.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)])
    extend_equal = [torch.equal(alone[i], batch[i]) for i in range(rows)]
    steps = [DecodeSeq(int(a.argmax()), len(p), pg) for a, p, pg in zip(alone, prompts, pages)]
    decode_alone = [runner.decode([s])[0] for s in steps]
    decode_batch = runner.decode(steps)
    for pg in pages:
        runner.kv_pool.free(pg)
    return extend_equal, [torch.equal(decode_alone[i], decode_batch[i]) for i in range(rows)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_rows_equal_their_solo_bits(dtype):
    runner = ModelRunner(RunnerConfig(model="tiny", page_size=4, num_pages=512, dtype=dtype, deterministic=True))
    extend_equal, decode_equal = _rows_vs_alone(runner, random.Random(), 16)
    assert all(extend_equal) and all(decode_equal), (extend_equal, decode_equal)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True])
def test_deterministic_rows_equal_their_solo_bits_on_the_gpu(graphs):
    """The GPU path: Triton backends with the batch-invariant kernels (no row splitting), bf16,
    eager and by CUDA-graph replay (a batch padded to its bucket)."""
    runner = ModelRunner(RunnerConfig(model="tiny", page_size=16, num_pages=512, dtype="bfloat16", device="cuda",
                                      deterministic=True, cuda_graph=graphs))
    extend_equal, decode_equal = _rows_vs_alone(runner, random.Random(), 16)
    assert all(extend_equal) and all(decode_equal), (extend_equal, decode_equal)


def test_without_the_flag_fp32_rows_differ_from_alone():
    """The variance --deterministic removes exists here: otherwise the test above proves nothing."""
    runner = ModelRunner(RunnerConfig(model="tiny", page_size=4, num_pages=512, dtype="float32"))
    extend_equal, decode_equal = _rows_vs_alone(runner, random.Random(), 16)
    assert not all(extend_equal + decode_equal)


@pytest.mark.parametrize("fields, match", [(dict(enable_tbo=True), "two-batch overlap"),
                                           (dict(speculative_num_steps=1), "speculative"),
                                           (dict(fp8_backend="triton"), "FP8")])
def test_deterministic_refuses_what_is_not_invariant(fields, match):
    with pytest.raises(UserError, match=match):
        RunnerConfig(model="tiny", deterministic=True, **fields)


def test_deterministic_picks_the_invariant_backends_and_mha():
    config = RunnerConfig(model="tiny", deterministic=True)
    # CPU: plain kernels, each sequence its own forward; CUDA: the invariant kernels
    assert config.kernel_backend("auto") == "torch" and config.resolved_attention_method == "mha"
    cuda = RunnerConfig(model="tiny", deterministic=True, device="cuda", attention_backend="triton")
    assert cuda.kernel_backend("triton") == "triton_invariant" and cuda.kernel_backend("torch") == "torch_invariant"
    assert RunnerConfig(model="tiny", device="cuda").kernel_backend("triton") == "triton"


def test_aligned_cuts_do_not_depend_on_the_queue():
    """Each prompt's cuts with others queued in any order equal its cuts alone (multiples of the chunk)."""
    rng = random.Random()
    for _ in range(50):
        chunk = rng.randrange(2, 12)
        lengths = [rng.randrange(1, 4 * chunk) for _ in range(rng.randrange(1, 6))]

        def cuts(order: list[int]) -> dict[int, list[tuple[int, int]]]:
            queue = [PromptProgress(list(range(lengths[i])), [], owner=i) for i in order]
            seen: dict[int, list[tuple[int, int]]] = {i: [] for i in order}
            while queue:
                plan = plan_extend_batch(queue, chunk, aligned=True)
                assert plan.items and sum(len(s.token_ids) for s in plan.seqs) <= chunk
                for item, seq in zip(plan.items, plan.seqs):
                    seen[item.owner].append((seq.prefix_len, seq.prefix_len + len(seq.token_ids)))
                plan.advance()
                queue = [q for q in queue if q.remaining]
            return seen

        together = cuts(rng.sample(range(len(lengths)), len(lengths)))
        for i, length in enumerate(lengths):
            assert together[i] == cuts([i])[i] == [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def test_the_gpu_build_runs_on_cpu_and_matches_the_plain_model():
    """The model as `--deterministic` builds it on CUDA (invariant linears, `torch_invariant` attention
    and MoE), here on CPU: same parameter names and loading, values within fp32 noise of the plain
    model's, through extend and decode."""
    from deepseek_pd.model.batch_invariant import InvariantLinear
    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.checkpoint.loader import load_model

    invariant = load_model("tiny", BuildOptions(deterministic=True, attention_backend="torch_invariant",
                                                moe_backend="torch_invariant"), progress=False)
    plain = load_model("tiny", BuildOptions(), progress=False)
    assert isinstance(invariant.lm_head, InvariantLinear)
    assert [name for name, _ in invariant.named_parameters()] == [name for name, _ in plain.named_parameters()]
    rng = random.Random()
    vocab = plain.config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    next_ids = [rng.randrange(2, vocab) for _ in prompts]  # the same decode inputs for both models
    results = []
    for model in (invariant, plain):
        runner = ModelRunner.from_model(model, RunnerConfig(model="<in-memory>", page_size=4, num_pages=128))
        pages = [runner.kv_pool.alloc(runner.kv_pool.pages_for_tokens(len(p) + 1)) for p in prompts]
        first = runner.extend([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)])
        second = runner.decode([DecodeSeq(t, len(p), pg) for t, p, pg in zip(next_ids, prompts, pages)])
        results.append((first, second))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-4, rtol=1e-4)
