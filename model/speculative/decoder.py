"""Speculative decoding with the MTP layer as the draft model (EAGLE/MTP chain, one draft per step).

Prefill: after each extend round the MTP layer runs over the same tokens (`mtp_over_extend`), so
its KV covers the prompt and each completed prompt has its first draft (`SpeculativeDecoder.seed`).
Positions, for a request whose last emitted token `x` sits at position P (not yet in the cache):
    draft     the MTP layer's last output (at P-1) already gave d1; chain step j (1..k-1) feeds
              (d_j, the previous MTP hidden) at position P+j-1 and drafts d_{j+1} (argmax).
    verify    one target extend of [x, d1..dk] at positions P..P+k: absorbed MLA over the paged
              cache, k+1 queries per sequence, causal among themselves (`mla_extend`).
    accept    position i's target token t_i is drawn by the request's own sampler, exactly as a
              plain decode step would draw it (argmax, or the seeded/unseeded draw from the
              processed distribution); it is emitted, and the next position is looked at only
              while t_i == d_{i+1} (`speculative_sampling.accept_drafts`). So the emitted tokens
              are the longest agreeing prefix plus the target's next token.
    catch up  the MTP layer re-runs over the emitted tokens (positions P..P+a) with the target's
              hidden states, overwriting what the chain wrote there; its last row drafts the next d1.
              With `pad_catch_up` (the runner has a catch-up CUDA graph) and every sequence having
              verified k + 1 tokens, it runs over all k + 1 verify positions instead, the emitted
              tokens padded with the last one: rows past the last emitted token write the MTP
              layer's KV at positions >= the next step's first, which the next step's chain and
              catch-up write again before any MTP row reads them (a row reads positions <= its
              own), and the next d1 is read from the last emitted row: the same drafts.
Rejected positions' KV (main cache and the MTP layer's pool layer) is dropped by rolling the
sequence back: the request's pages hold prompt + max_new - 1 tokens and drafts never reach past
them (`speculative_rules.draft_len`), so later steps overwrite those slots and nothing leaks.

With greedy sampling the output is the target's token for token; with sampling it has the target's
distribution for any temperature / top-p / top-k / penalties (the draft is deterministic, so
accepting d exactly when the target's own draw equals d is rejection sampling with a one-hot draft
distribution: P(d) = p(d), P(x != d) = p(x)); with a seed, even the same tokens as without
speculation, since the target draws each step from the same (seed, step) noise.
Stop strings, max tokens and logprobs go through the request's own sampler and stop checker one
token at a time, so they behave as without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.speculative.rules import draft_len
from deepseek_pd.model.speculative.acceptance import AcceptStats, SampleFn, accept_drafts

if TYPE_CHECKING:
    from deepseek_pd.model.speculative.policy import StepCosts


class SpecRequest(Protocol):
    """What the speculative loop reads of a request (the offline engine's `_Request`, the decode worker's `SpecRow`)."""

    prompt_ids: list[int]
    output_ids: list[int]
    pages: list[int]
    max_new: int

    @property
    def finished(self) -> bool: ...


@dataclass
class _Draft:
    token: int  # d1 for the next step
    hidden: torch.Tensor  # [H] the MTP layer's normed output at the last emitted token's position - 1


class SpeculativeDecoder:
    def __init__(self, runner: ModelRunner, num_steps: int, sample: SampleFn, pad_catch_up: bool | None = None) -> None:
        if runner.model.mtp is None:
            raise RuntimeError("speculative decoding needs a runner built with its MTP layer")
        self.runner = runner
        self.num_steps = num_steps
        # Default: when the runner's catch-up runs as a CUDA graph of k + 1 tokens per sequence.
        graphs = runner.spec_forwards.graphs
        self.pad_catch_up = (graphs is not None and bool(graphs.catch_up_graphs)) if pad_catch_up is None \
            else pad_catch_up
        self.sample = sample
        self.stats = AcceptStats()
        self._drafts: dict[int, _Draft] = {}

    # ---- one decode step ----------------------------------------------------------------------
    def step(self, requests: Sequence[SpecRequest], num_steps: int | None = None) -> None:
        """Draft, verify, accept and catch up once for every unfinished request; `num_steps`
        (default: the configured number) drafts per request this step, 0 for none."""
        steps = self.num_steps if num_steps is None else min(num_steps, self.num_steps)
        requests = [r for r in requests if not r.finished]
        positions = [len(r.prompt_ids) + len(r.output_ids) - 1 for r in requests]
        # A request with no draft yet (its prompt's KV came from elsewhere and no draft came with it)
        # verifies its token alone this step; the catch-up then starts its drafts.
        lens = [draft_len(steps, r.max_new - len(r.output_ids)) if id(r) in self._drafts else 0
                for r in requests]
        drafts = self._chain(requests, positions, lens)
        seqs = [ExtendSeq([r.output_ids[-1], *d], prefix_len=p, pages=r.pages)
                for r, d, p in zip(requests, drafts, positions)]
        hidden = self.runner.extend_hidden(seqs, force_mla=True)
        logits = self.runner.logits(hidden)
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + len(s.token_ids))
        emitted = accept_drafts(requests, drafts, logits, starts, self.sample, self.stats)
        live = [i for i, r in enumerate(requests) if not r.finished]
        if live:
            q = steps + 1
            padded = self.pad_catch_up and steps > 0 and all(len(seqs[i].token_ids) == q for i in live)
            spans = [q if padded else emitted[i] for i in live]
            rows = torch.cat([torch.arange(starts[i], starts[i] + n) for i, n in zip(live, spans)]).to(hidden.device)
            tokens = [requests[i].output_ids[-emitted[i]:] + [requests[i].output_ids[-1]] * (n - emitted[i])
                      for i, n in zip(live, spans)]
            self._catch_up([requests[i] for i in live], tokens, [positions[i] for i in live], hidden[rows],
                           [emitted[i] for i in live])
        for r in requests:
            if r.finished:
                self._drafts.pop(id(r), None)

    def seed(self, request: SpecRequest, token: int, hidden: torch.Tensor) -> None:
        """Its first draft, from an MTP pass over its prompt that ran elsewhere (`mtp_over_extend`,
        in a colocated prefill round or on the prefill worker)."""
        self._drafts[id(request)] = _Draft(token, hidden)

    def forget(self, request: SpecRequest) -> None:
        """Drops a request's draft state (it ended, by a stop, an abort or a failure)."""
        self._drafts.pop(id(request), None)

    def _chain(self, requests: list[SpecRequest], positions: list[int], lens: list[int]) -> list[list[int]]:
        """Each request's draft tokens: d1 from the last catch-up, then k-1 MTP decode steps."""
        drafts = [[self._drafts[id(r)].token] if k else [] for r, k in zip(requests, lens)]
        hidden = {i: self._drafts[id(r)].hidden for i, (r, k) in enumerate(zip(requests, lens)) if k}
        for j in range(1, max(lens, default=0)):
            rows = [i for i, k in enumerate(lens) if k > j]
            seqs = [ExtendSeq([drafts[i][-1]], prefix_len=positions[i] + j - 1, pages=requests[i].pages)
                    for i in rows]
            out = self.runner.draft(seqs, torch.stack([hidden[i] for i in rows]))
            tokens = self.runner.logits(out).argmax(dim=-1).tolist()
            for n, i in enumerate(rows):
                drafts[i].append(tokens[n])
                hidden[i] = out[n]
        return drafts

    def _catch_up(self, requests: list[SpecRequest], tokens: list[list[int]], prefix_lens: list[int],
                  target_hidden: torch.Tensor, emitted: list[int]) -> None:
        """MTP over (emitted token, target hidden) pairs from `prefix_lens` (`tokens[i]`: the
        `emitted[i]` emitted, then any padding); stores each next d1, from its last emitted row."""
        seqs = [ExtendSeq(t, prefix_len=p, pages=r.pages) for r, t, p in zip(requests, tokens, prefix_lens)]
        out = self.runner.draft(seqs, target_hidden)
        starts = [0, *_cumsum(len(t) for t in tokens)][:-1]
        last = torch.tensor([start + n - 1 for start, n in zip(starts, emitted)], device=out.device)
        out = out[last]
        next_tokens = self.runner.logits(out).argmax(dim=-1).tolist()
        for r, token, h in zip(requests, next_tokens, out):
            self._drafts[id(r)] = _Draft(token, h)


def _cumsum(values) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def mtp_over_extend(runner: ModelRunner, seqs: Sequence[ExtendSeq], hidden: torch.Tensor,
                    prompts: Sequence[Sequence[int]], first_tokens: dict[int, int]) -> list[tuple[int, torch.Tensor]]:
    """The MTP layer over one extend round's tokens, right after it (a chunk of each prompt), so the
    MTP layer's KV of those positions is in the pages with the rest: at position p it takes the
    token at p + 1, the prompt's own, or for sequence i that completes its prompt `first_tokens[i]`
    (its sampled first token). `hidden` `[T, H]` are the round's target hidden states
    (`extend_hidden`). Returns (first draft, MTP hidden) of each completing sequence, in row order.
    """
    draft_seqs = []
    for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
        end = seq.prefix_len + len(seq.token_ids)
        after = prompt[end] if end < len(prompt) else first_tokens[i]
        draft_seqs.append(ExtendSeq([*prompt[seq.prefix_len + 1:end], after], seq.prefix_len, seq.pages))
    out = runner.draft(draft_seqs, hidden)
    rows = sorted(first_tokens)
    if not rows:
        return []
    ends = _cumsum(len(s.token_ids) for s in seqs)
    last = out[torch.tensor([ends[i] - 1 for i in rows], device=out.device)]
    tokens = runner.logits(last).argmax(dim=-1).tolist()
    return list(zip(tokens, last))


def measure_step_costs(runner: ModelRunner, batches: Sequence[int], max_steps: int, context: int,
                       repeats: int = 3) -> "StepCosts":
    """Median milliseconds of one speculative step (k - 1 MTP decode steps, a verify of k + 1 tokens
    per sequence, an MTP catch-up of k + 1 tokens: its largest) for k = 0..max_steps at each batch
    size, over `context` cached tokens of scratch pages (whatever they hold: costs do not depend
    on it). The table `speculation_policy.SpeculationPolicy` chooses from."""
    import statistics
    import time

    from deepseek_pd.model.speculative.policy import StepCosts

    pool, device = runner.kv_pool, runner.model.embed_tokens.weight.device
    hidden_size, dtype = runner.model_config.hidden_size, runner.model.embed_tokens.weight.dtype

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    table = [[0.0] * len(batches) for _ in range(max_steps + 1)]
    for col, batch in enumerate(batches):
        pages = [pool.alloc(pool.pages_for_tokens(context + max_steps + 1)) for _ in range(batch)]
        try:
            h = torch.zeros(batch, hidden_size, dtype=dtype, device=device)
            for k in range(max_steps + 1):
                def one_step() -> None:
                    for j in range(1, k):
                        runner.logits(runner.draft([ExtendSeq([1], context + j - 1, p) for p in pages], h))
                    verify = [ExtendSeq([1] * (k + 1), context, p) for p in pages]
                    states = runner.extend_hidden(verify, force_mla=True)
                    runner.logits(states)
                    runner.logits(runner.draft(verify, states))
                one_step()  # warm-up
                sync()
                times = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    one_step()
                    sync()
                    times.append((time.perf_counter() - began) * 1e3)
                table[k][col] = max(statistics.median(times), 1e-6)
        finally:
            for p in pages:
                pool.free(p)
    return StepCosts(tuple(batches), tuple(tuple(row) for row in table))
