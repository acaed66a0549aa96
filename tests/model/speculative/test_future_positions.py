"""Future positions (model/speculative/future_positions.py): a batch built on the host from upper
bounds of its prefix lengths, its positions, KV slots and lengths then filled in on the device
from the true ones, equals the batch built from the true lengths (`ForwardBatch.build`, the
oracle), with nothing read back; so do the CUDA graphs' static verify and draft inputs (filled on
the CPU here, where nothing is captured). And the next step's starts are the last step's plus its
emitted counts, clamped into each row's pages.
"""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.forward_batch import ForwardBatch, ForwardMode
from deepseek_pd.model.graph_inputs import StaticDecodeInputs
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.speculative.future_positions import FuturePositions, fill_static, with_device_starts
from deepseek_pd.model.speculative.verify_graph import StaticVerifyInputs
from pdtest.host_reads import HostReads

PAGES, VOCAB = 64, 50


def _rows(rng: random.Random, page: int, n: int, q: int | None = None):
    """n sequences: (new tokens, true prefix, bound >= it, pages that hold the bound's tokens)."""
    rows = []
    for _ in range(n):
        extend = q or rng.randint(1, 5)
        prefix = rng.randint(0, 20)
        bound = prefix + rng.randint(0, 6)
        pages = rng.sample(range(PAGES - 1), -(-(bound + extend) // page) + rng.randint(0, 1))
        rows.append(([rng.randrange(VOCAB) for _ in range(extend)], prefix, bound, pages))
    return rows


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_device_starts_give_the_batch_of_the_true_lengths(mode):
    rng = random.Random()
    for _ in range(20):
        page = rng.choice([1, 2, 4, 8])
        pool = KVPool(1, PAGES, page, 4)
        rows = _rows(rng, page, rng.randint(1, 6), 1 if mode is ForwardMode.DECODE else None)
        tokens, prefixes, bounds, pages = map(list, zip(*rows))
        want = ForwardBatch.build(mode, tokens, prefixes, pages, pool, VOCAB, "cpu")
        got = ForwardBatch.build(mode, tokens, bounds, pages, pool, VOCAB, "cpu")
        starts = torch.tensor(prefixes)
        with HostReads() as reads:
            with_device_starts(got, starts)
        assert reads.seen == []
        for name in ("positions", "out_slots", "seq_lens_t", "token_seq", "qo_indptr", "input_ids"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert all(b >= p for b, p in zip(got.seq_lens, want.seq_lens))  # host lengths only bound


def test_graph_inputs_filled_from_device_starts_equal_the_exact_packing():
    rng = random.Random()
    for _ in range(10):
        page, q, bucket, width = rng.choice([2, 4]), rng.randint(1, 4), 8, 16
        pool = KVPool(1, PAGES, page, 4)
        n = rng.randint(1, bucket)
        tokens, prefixes, bounds, pages = map(list, zip(*_rows(rng, page, n, q)))
        starts = torch.tensor(prefixes)
        if q == 1:  # the draft step's (and decode's) buffer
            exact, future = (StaticDecodeInputs(bucket, width, pool, PAGES - 1, VOCAB) for _ in range(2))
            exact.load(exact.pack([t[0] for t in tokens], prefixes, pages))
            future.load(future.pack([t[0] for t in tokens], bounds, pages))
        else:  # the verify's and the catch-up's
            exact, future = (StaticVerifyInputs(bucket, q, width, pool, PAGES - 1, VOCAB) for _ in range(2))
            exact.load(exact.pack(tokens, prefixes, pages))
            future.load(future.pack(tokens, bounds, pages))
        with HostReads() as reads:
            fill_static(future.positions, future.out_slots, future.seq_lens, future.page_table, starts, q, page)
        assert reads.seen == []
        assert torch.equal(future.packed, exact.packed)


def test_the_next_starts_add_the_emitted_counts_within_each_rows_room():
    rng = random.Random()
    for _ in range(20):
        n = rng.randint(1, 6)
        positions = [rng.randint(0, 30) for _ in range(n)]
        most = [rng.randint(1, 4) for _ in range(n)]
        emitted = [rng.randint(1, m) for m in most]
        room = [p + rng.randint(0, 6) for p in positions]
        now = FuturePositions.known(positions, "cpu")
        with HostReads() as reads:
            nxt = now.advanced(torch.tensor(emitted), most, room)
        assert reads.seen == []
        assert nxt.starts.tolist() == [min(p + e, r) for p, e, r in zip(positions, emitted, room)]
        assert nxt.bounds == tuple(min(p + m, r) for p, m, r in zip(positions, most, room))
        assert all(s <= b for s, b in zip(nxt.starts.tolist(), nxt.bounds))
    with pytest.raises(ValueError, match="counts"):
        FuturePositions.known([1, 2], "cpu").advanced(torch.tensor([1, 1]), [1], [5, 5])
    with pytest.raises(ValueError, match="no room"):
        FuturePositions.known([1], "cpu").advanced(torch.tensor([1]), [1], [-1])
    with pytest.raises(ValueError, match="starts must be"):
        FuturePositions(torch.zeros(2, dtype=torch.long), (0,))


@pytest.mark.usefixtures("one_torch_thread")
def test_forwards_from_device_starts_equal_the_exact_ones(tiny_mtp_checkpoint):
    """The verify (absorbed MLA extend), a draft step (MTP decode) and the catch-up (MTP extend) of a
    batch whose host prefixes only bound the true ones, against the same forwards built from the
    true prefixes. The cache past each row's true end holds NaN (stale KV a bound must not reach:
    the keys past a row's true length are masked by its device length)."""
    from deepseek_pd.model.runner import ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    rng = random.Random()
    runner = ModelRunner(RunnerConfig(model=str(tiny_mtp_checkpoint), page_size=4, num_pages=64,
                                      speculative_num_steps=3))
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    n, q = 3, rng.randint(1, 4)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    slack = [rng.randint(0, 5) for _ in range(n)]
    pages = [pool.alloc(pool.pages_for_tokens(len(p) + s + q)) for p, s in zip(prompts, slack)]
    prompt_hidden = runner.extend_hidden([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)])
    runner.draft([ExtendSeq(p, 0, pg) for p, pg in zip(prompts, pages)], prompt_hidden)
    true = [len(p) for p in prompts]
    bounds = [t + s for t, s in zip(true, slack)]
    for buffer in pool.buffers:  # stale NaN past each row's true end
        for row_pages, end in zip(pages, true):
            flat = torch.tensor([pg * pool.page_size + j for pg in row_pages for j in range(pool.page_size)])
            buffer.view(-1, buffer.shape[-1])[flat[end + q:]] = float("nan")
    new = [[rng.randrange(vocab) for _ in range(q)] for _ in range(n)]
    hidden_in = torch.randn(n * q, runner.model_config.hidden_size, generator=torch.Generator().manual_seed(
        rng.randrange(1 << 30)))
    starts = torch.tensor(true)

    def forwards(prefixes, device_starts):
        seqs = [ExtendSeq(t, p, pg) for t, p, pg in zip(new, prefixes, pages)]
        verify = runner.extend_hidden(seqs, force_mla=True, starts=device_starts)
        first = [ExtendSeq(t[:1], p, pg) for t, p, pg in zip(new, prefixes, pages)]
        draft = runner.draft(first, hidden_in[::q], starts=device_starts)
        catch_up = runner.draft(seqs, hidden_in, starts=device_starts)
        return verify, draft, catch_up

    exact = forwards(true, None)
    future = forwards(bounds, starts)
    for want, got in zip(exact, future):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not runner.spec_forwards.needs_host_lengths
    backend = runner.model.layers[-1].self_attn.backend
    backend.device_lengths = False  # as FlashInfer and torch_invariant declare: they need host lengths
    assert runner.spec_forwards.needs_host_lengths


class _Row:
    """A greedy request (decoder.SpecRequest) whose budget no step of the test reaches."""

    def __init__(self, prompt: list[int], max_new: int, pages: list[int], sampling) -> None:
        self.prompt_ids, self.output_ids, self.max_new = prompt, [1], max_new
        self.pages, self.sampling = pages, sampling

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new


@pytest.mark.usefixtures("one_torch_thread")
def test_a_long_chain_launched_ahead_keeps_drafting(tiny_mtp_checkpoint):
    """Steps launched one ahead of the other for many steps: each drafts the full k while the rows'
    budgets are far (its bounds come from where the one unread step started, which the host knows,
    so they do not add up step after step: before, drafts fell to 0 halfway through the budget),
    and its tokens are those of the same steps launched in order."""
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.model.sampling.state import SamplingState
    from deepseek_pd.model.speculative.decoder import SpeculativeDecoder

    rng = random.Random()
    k, steps = 3, 16
    runner = ModelRunner(RunnerConfig(model=str(tiny_mtp_checkpoint), page_size=4, num_pages=256,
                                      speculative_num_steps=k))
    pool, config = runner.kv_pool, runner.model_config
    hidden = torch.zeros(config.hidden_size)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(1, 6))] for _ in range(2)]
    # The untrained MTP layer's drafts are (nearly) all rejected: 1 token a step, so the budget stays
    # far from every step's drafts; bounds that assumed k + 1 tokens a step would reach it at step 9.
    max_new = 40

    def run(ahead: bool) -> tuple[list[list[int]], list[list[int]]]:
        decoder = SpeculativeDecoder(runner, k)
        rows = [_Row(p, max_new, pool.alloc(pool.pages_for_tokens(len(p) + max_new)),
                     SamplingState.create(SamplingParams(temperature=0.0), p, config.vocab_size, "cpu"))
                for p in prompts]
        try:
            for row in rows:
                decoder.seed(row, 1, hidden)
            run = decoder.run(rows, ahead, max_steps=steps)
            assert run.launched_ahead == (steps - 1 if ahead else 0)
            return run.lens, [r.output_ids for r in rows]
        finally:
            for row in rows:
                pool.free(row.pages)

    ahead_lens, ahead_out = run(True)
    in_order_lens, in_order_out = run(False)
    assert ahead_out == in_order_out
    assert in_order_lens == [[k, k]] * len(in_order_lens)
    assert ahead_lens == in_order_lens
