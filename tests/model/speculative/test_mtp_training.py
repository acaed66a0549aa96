"""Training the MTP layer (model/speculative/training.py), the helper the speculative tests and
bench/mtp_trained_gpu.py share: greedy labels are the target's own greedy tokens (oracle: the
offline engine's greedy output), a layer whose backends have no backward path of their own is
trained as a torch-backend copy and copied back into the model's own tensors (CUDA graphs keep
their addresses: the KV pool's MTP layer too), and weights below fp32 train through fp32 masters."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.speculative.training import _training_pairs, mtp_accuracy, train_mtp, trainable_mtp
from deepseek_pd.workers.engine.offline import Engine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def greedy_sequences(tiny_mtp_checkpoint, module_seed):
    """(engine, prompts, prompt + greedy output per prompt)."""
    engine = Engine(str(tiny_mtp_checkpoint), page_size=4)
    rng = random.Random(module_seed)
    prompts = [[rng.randrange(2, engine.vocab_size) for _ in range(rng.randint(2, 8))] for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(8, 16), ignore_eos=True)
    return engine, prompts, [p + r.output_ids for p, r in zip(prompts, engine.generate_batch(prompts, greedy))]


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=str(path), device="cpu", page_size=4, num_pages=256,
                                    speculative_num_steps=2, **kw))


def test_greedy_labels_are_the_targets_greedy_tokens(tiny_mtp_checkpoint, greedy_sequences):
    _, prompts, seqs = greedy_sequences
    runner = _runner(tiny_mtp_checkpoint, dtype="float32")
    _, _, greedy = _training_pairs(runner, seqs, "greedy")
    _, _, tokens = _training_pairs(runner, seqs, "tokens")
    # Row p of a sequence labels position p + 2; past the prompt that token is the engine's greedy one.
    at = 0
    for prompt, seq in zip(prompts, seqs):
        rows = range(at + len(prompt) - 2, at + len(seq) - 2)  # labels of the generated tokens
        assert greedy[list(rows)].tolist() == tokens[list(rows)].tolist() == seq[len(prompt):]
        assert greedy[at + len(seq) - 2] == tokens[at + len(seq) - 2] == -100  # the last row has none
        at += len(seq) - 1


def test_a_copy_trains_where_the_backends_are_not_torch(tiny_mtp_checkpoint, greedy_sequences):
    _, _, seqs = greedy_sequences
    runner = _runner(tiny_mtp_checkpoint, dtype="float32", moe_backend="grouped")
    mtp, pool = runner.model.mtp, runner.kv_pool
    assert trainable_mtp(runner) is not mtp
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in mtp.named_parameters()}
    kv = pool.buffers[mtp.layer_id]
    accuracy, steps = train_mtp(runner, seqs, seconds=3.0, lr=1e-2)
    assert steps > 0 and accuracy > 0.3, (accuracy, steps)
    assert pool.buffers[mtp.layer_id] is kv  # a captured graph's address
    # The model's own layer (grouped MoE, fp32) drafts what the trained torch copy predicted, but
    # for the last step's update (accuracy is measured before it) and fp32 near-ties.
    assert abs(mtp_accuracy(runner, seqs) - accuracy) < 0.15, (mtp_accuracy(runner, seqs), accuracy)
    assert pool.num_used_pages == 0
    moved = 0
    for name, p in mtp.named_parameters():
        ptr, old = before[name]
        assert p.data_ptr() == ptr, name  # trained values copied into the model's own tensors
        moved += not torch.equal(p, old)
    assert moved > len(before) // 2
    assert not any(p.requires_grad for p in mtp.parameters()) or all(p.requires_grad for p in mtp.parameters())


def test_bf16_trains_through_fp32_masters(tiny_mtp_checkpoint, greedy_sequences):
    _, _, seqs = greedy_sequences
    runner = _runner(tiny_mtp_checkpoint, dtype="bfloat16")
    dtypes = {name: p.dtype for name, p in runner.model.mtp.named_parameters()}
    assert dtypes["eh_proj.weight"] == torch.bfloat16
    accuracy, steps = train_mtp(runner, seqs, seconds=4.0, lr=1e-2)
    assert steps > 0 and accuracy > 0.3, (accuracy, steps)
    assert {name: p.dtype for name, p in runner.model.mtp.named_parameters()} == dtypes
    assert runner.kv_pool.num_used_pages == 0


def test_chain_depth_training_drafts_every_step_of_its_sequences(tiny_mtp_checkpoint, greedy_sequences):
    """A layer trained at depth 3 on sequences drafts all 3 of a step's tokens on them: accept
    length near 4 (depth 1 alone, fp32: about 2.3, since the chain's later drafts take the layer's
    own output, which depth 1 never feeds it). The oracle for the tokens: the engine without drafts."""
    engine, prompts, seqs = greedy_sequences
    steps = 3
    spec = Engine(str(tiny_mtp_checkpoint), page_size=4, speculative_num_steps=steps)
    accuracy, _ = train_mtp(spec.runner, seqs, seconds=20.0, lr=1e-2, depth=steps)
    assert accuracy == 1.0, accuracy  # every depth memorised its labels
    assert mtp_accuracy(spec.runner, seqs) == 1.0  # the drafting layer itself, depth 1
    greedy = SamplingParams(temperature=0.0, max_new_tokens=len(seqs[0]) - len(prompts[0]), ignore_eos=True)
    got = spec.generate_batch(prompts, greedy)
    assert [p + r.output_ids for p, r in zip(prompts, got)] == seqs
    stats = spec.speculative.stats
    # Every step but a row's last (cut by its budget) emits steps + 1 tokens.
    assert stats.accept_length > steps, (stats.accept_length, dict(stats.histogram))
