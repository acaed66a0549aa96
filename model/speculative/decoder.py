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
              while t_i == d_{i+1} (`acceptance.accept_on_device`). So the emitted tokens
              are the longest agreeing prefix plus the target's next token.
    catch up  the MTP layer re-runs over the emitted tokens (positions P..P+a) with the target's
              hidden states, overwriting what the chain wrote there; its last emitted row drafts
              the next d1. It runs over all of a sequence's verify positions, the emitted tokens
              padded with the last one (so its shape is known before the step, and with k + 1
              tokens everywhere it is the catch-up CUDA graph's): rows past the last emitted token write the MTP
              layer's KV at positions >= the next step's first, which the next step's chain and
              catch-up write again before any MTP row reads them (a row reads positions <= its
              own), and the next d1 is read from the last emitted row: the same drafts.
Rows near their budgets draft fewer (`draft_len`). Where the runner has verify CUDA graphs, such a
step still verifies the same number of tokens in every row (the step's most, or the next count
with a captured graph): a row's slots past its drafts hold draft -1 (never accepted; token 0 is
fed), and its positions past its own pages write into the graphs' scratch page. Those positions
are past the row's last real one, so nothing real reads them (each query reads positions <= its
own); without the padding the step's verify and catch-up would run eagerly (on an H100, V2-Lite,
a batch of 32 paid 1.8x a step for its tail of rows at different budgets).
Rejected positions' KV (main cache and the MTP layer's pool layer) is dropped by rolling the
sequence back: the request's pages hold prompt + max_new - 1 tokens and drafts never reach past
them (`speculative_rules.draft_len`), so later steps overwrite those slots and nothing leaks.

With greedy sampling the output is the target's token for token; with sampling it has the target's
distribution for any temperature / top-p / top-k / penalties (the draft is deterministic, so
accepting d exactly when the target's own draw equals d is rejection sampling with a one-hot draft
distribution: P(d) = p(d), P(x != d) = p(x)); with a seed, even the same tokens as without
speculation, since the target draws each step from the same (seed, step) noise.
Stop strings, max tokens and logprobs go through the request's own emit and stop checker one
token at a time, so they behave as without speculation.

Where the step's state lives (as SGLang keeps it): on the device. `launch` queues the whole step
(chain, verify, acceptance, catch-up) without reading any value back: the drafts, the verify's
input ids, the acceptance (`acceptance.accept_on_device`, all positions drawn at once by the rows'
`SamplingBatch`), the accepted and emitted counts, the catch-up's tokens and the next drafts
(token and hidden state per request) are device tensors; what the host supplies (positions, draft
lengths, pages, row indices) is host knowledge from before the step. The next drafts are kept as the
catch-up's batch tensors, and a step whose rows all draft the most (the common one) uses them, the
verify's ids and hidden states as they are: no per-row gathers, so a step's eager ops (kernel
launches beside its forwards' graph replays) do not grow with the batch (bench/speculative_ops.py). The catch-up always covers
every verify position (padded as above), so its shape needs no emitted count. `finish` makes the
step's ONE device-to-host read (tokens, logprobs, top logprobs, emitted counts; `HostCopy`, so a
caller may launch other work first), then appends each request's tokens through `emit` one at a
time (a stop ends them there) and counts the stats.

Steps overlap (`launch(after=...)`): the next step can be queued before the last one is read,
since everything it takes from it stays on the device: its positions and KV slots (the last
step's plus its emitted counts, future_positions.py), its first verify token (the last emitted
one, gathered from the draws), its d1 and MTP hidden state (the catch-up's). The host knows only
bounds there, so each row drafts for the most the last step may have emitted (a row near its
budget drafts fewer: only speed changes, never a token) and a row whose request ended in the last
step runs once more, clamped into its own pages, and is skipped by `finish` (a void row; its tokens
count in no expert load, `_counted_tokens`). The rows
must be the last step's (`can_launch_ahead`): a row change reads the last step first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Protocol, Sequence

import torch

from deepseek_pd.model.host_copy import HostCopy, upload
from deepseek_pd.model.runner import ExtendSeq, ModelRunner
from deepseek_pd.model.sampling.batch import SamplingBatch
from deepseek_pd.model.sampling.sampled_host import TopLogprobs, pack, unpack
from deepseek_pd.model.sampling.state import SamplingState
from deepseek_pd.model.speculative.rules import draft_len
from deepseek_pd.model.speculative.acceptance import AcceptStats, accept_on_device
from deepseek_pd.model.speculative.future_positions import FuturePositions
from deepseek_pd.model.speculative.policy import SpeculationPolicy



class SpecRequest(Protocol):
    """What the speculative loop reads of a request (the offline engine's `_Request`, the decode worker's `SpecRow`)."""

    prompt_ids: list[int]
    output_ids: list[int]
    pages: list[int]
    max_new: int
    sampling: SamplingState  # its draws; the decoder's `SamplingBatch` holds it while it decodes

    @property
    def finished(self) -> bool: ...


# Appends one emitted token (id, logprob, top logprobs or None) to a request: its output, logprobs
# and stop checker (the offline engine's `_record`). Called in order; a request that is `finished`
# afterwards gets no more of this step's tokens.
EmitFn = Callable[[Any, int, float, "TopLogprobs | None"], None]


def append_token(request: SpecRequest, token: int, logprob: float, top: TopLogprobs | None) -> None:
    """The plainest `EmitFn`: the token joins `output_ids`."""
    request.output_ids.append(token)


@dataclass
class _Draft:
    """A request's next d1 and MTP hidden state: row `row` of a batch's (the catch-up's, kept whole
    so the next chain over the same rows takes the batch as it is, with no per-row gathers)."""

    tokens: torch.Tensor  # [N] long on the device: d1 for the next step
    hidden: torch.Tensor  # [N, H] the MTP layer's normed output at the last emitted token's position - 1
    row: int


@dataclass
class LaunchedSpecStep:
    """A queued speculative step; `SpeculativeDecoder.finish` reads its one host copy."""

    requests: list  # the step's rows, in order
    lens: list[int]  # drafts verified per row
    q: int  # positions drawn per row (the longest verify)
    host: HostCopy  # [B * q, 2 + 2K + 1] float64: sampled_host.pack, then the row's accepted count
    top_counts: tuple[int, ...]
    # What the next step takes from this one on the device when it is launched before this one is
    # read (`launch(after=...)`): each row's verify start, the target's draws, the emitted counts.
    starts: FuturePositions
    tokens: torch.Tensor  # [B, q] long
    emitted: torch.Tensor  # [B] long
    accepted: torch.Tensor  # [B] long: emitted - 1, the column of each row's last emitted token


@dataclass
class SpecRun:
    """What `SpeculativeDecoder.run` launched: each step's draft lengths, the draft count asked of
    each step (the policy's choice, or the fixed one; a row near its budget drafts fewer), and how
    many steps were launched before the step ahead of them was read."""

    lens: list[list[int]] = field(default_factory=list)
    requested: list[int] = field(default_factory=list)
    launched_ahead: int = 0


class SpeculativeDecoder:
    def __init__(self, runner: ModelRunner, num_steps: int, emit: EmitFn = append_token,
                 fallback_generator: torch.Generator | None = None) -> None:
        if runner.model.mtp is None:
            raise RuntimeError("speculative decoding needs a runner built with its MTP layer")
        self.runner = runner
        self.num_steps = num_steps
        self.device = torch.device(runner.model.options.device)
        self.emit = emit
        # False: the catch-up covers only the emitted tokens, which needs their counts on the host
        # (a sync): the reference the padded catch-up is tested against.
        self.pad_catch_up = True
        self.sampling = SamplingBatch(runner.model_config.vocab_size, self.device, fallback_generator)
        self.stats = AcceptStats()
        self._drafts: dict[int, _Draft] = {}
        self._unread: list[LaunchedSpecStep] = []  # launched steps not yet finished
        self._aranges: dict[int, torch.Tensor] = {}

    # ---- one decode step ----------------------------------------------------------------------
    def step(self, requests: Sequence[SpecRequest], num_steps: int | None = None) -> None:
        """Draft, verify, accept and catch up once for every unfinished request; `num_steps`
        (default: the configured number) drafts per request this step, 0 for none."""
        launched = self.launch(requests, num_steps)
        if launched is not None:
            self.finish(launched)

    def launch(self, requests: Sequence[SpecRequest], num_steps: int | None = None,
               after: LaunchedSpecStep | None = None) -> LaunchedSpecStep | None:
        """Queues one step (module docstring) and returns without reading anything back. `after`: the
        step before, launched and not yet read (`can_launch_ahead`): this one starts where it ends,
        from its device counts (future_positions.py), and `finish` reads the two in order."""
        steps = self.num_steps if num_steps is None else min(num_steps, self.num_steps)
        requests = [r for r in requests if not r.finished]
        if after is not None and not self.can_launch_ahead(requests, after):
            raise ValueError("a step launched ahead needs the rows of the step before it, that step the only "
                             "one unread, and lengths on the device only (finish that step first)")
        if not requests:
            return None
        self._sync_rows([r.sampling for r in requests])
        # A request with no draft yet (its prompt's KV came from elsewhere and no draft came with it)
        # verifies its token alone this step; the catch-up then starts its drafts.
        has_draft = [id(r) in self._drafts for r in requests]
        if after is None:
            lens = [draft_len(steps, r.max_new - len(r.output_ids)) if d else 0 for r, d in zip(requests, has_draft)]
            positions = [len(r.prompt_ids) + len(r.output_ids) - 1 for r in requests]
            known = self._upload(positions + [r.output_ids[-1] for r in requests])  # one copy for both
            starts = FuturePositions(known[:len(requests)], tuple(positions))
            last = known[len(requests):]
            exact = None  # the host's lengths are exact: the forwards need no device starts
            counted = None  # no row is void
        else:
            # Each row emitted 1..k+1 tokens in `after` (unknown here): its drafts are chosen for the
            # most it may have emitted, so they stay inside its budget whatever it emitted. `after`
            # is the only unread step, so the host knows where it started (its own bounds, if it was
            # launched ahead too, may be looser: they would add up step after step).
            base = [min(b, len(r.prompt_ids) + len(r.output_ids) - 1) for b, r in zip(after.starts.bounds, requests)]
            most = [k + 1 for k in after.lens]
            outputs = [b + m - len(r.prompt_ids) + 1 for b, m, r in zip(base, most, requests)]
            lens = [draft_len(steps, r.max_new - n) if d else 0 for r, n, d in zip(requests, outputs, has_draft)]
            page_size = self.runner.kv_pool.page_size
            room = [len(r.pages) * page_size - 1 - k for r, k in zip(requests, lens)]
            starts = FuturePositions(after.starts.starts, tuple(base)).advanced(after.emitted, most, room)
            last = after.tokens.gather(1, after.accepted.unsqueeze(1)).squeeze(1)  # its last emitted token
            exact = starts.starts
            counted = self._counted_tokens(requests, after, lens)
        # Slots each row verifies: its drafts, or with `padding` the same for every row, the step's
        # most or the next count with a captured verify graph, so the verify and catch-up keep the
        # shape of their CUDA graphs when rows draft fewer (near their budgets; a runner with graphs
        # for the configured k only); the padding's drafts are -1, never accepted.
        padding = self._padding_pages()
        q = max(lens) + 1 if padding is None else self._graph_width(max(lens) + 1)
        widths = lens if padding is None else [q - 1] * len(lens)
        drafts = self._chain(requests, starts, exact is not None, lens, q - 1)  # [B, q-1], -1 past a row's drafts
        seqs = [ExtendSeq([0] * (w + 1), prefix_len=p, pages=self._verify_pages(r.pages, p + w + 1, padding))
                for r, w, p in zip(requests, widths, starts.bounds)]
        # Row i's verify tokens [x, d1..dk], packed: its cells of the [B, q] table [x | drafts]. Every
        # row verifying the most (the common step): the table itself, no gathers (`cells` None).
        uniform = min(widths) == q - 1
        cells = None if uniform else self._upload([i * q + j for i, w in enumerate(widths) for j in range(w + 1)])
        padded = drafts.clamp(min=0) if min(lens) < q - 1 and uniform else drafts  # -1 is no token id
        verify_ids = torch.cat([last.unsqueeze(1), padded], dim=1).reshape(-1)
        if cells is not None:
            verify_ids = verify_ids.index_select(0, cells)
        hidden = self.runner.extend_hidden(seqs, force_mla=True, input_ids=verify_ids, starts=exact, counted=counted)
        starts_at = [0]  # each row's first verify row
        for w in widths:
            starts_at.append(starts_at[-1] + w + 1)
        # Row i's position j is verify row starts_at[i] + min(j, w_i): past its slots, its last again
        # (drawn, never kept: its drafts there are -1).
        rows_at = hidden if uniform else hidden.index_select(0, self._upload(
            [starts_at[i] + min(j, w) for i, w in enumerate(widths) for j in range(q)]))
        logits = self.runner.logits(rows_at).view(len(requests), q, -1)
        result = accept_on_device(self.sampling, logits, drafts)
        self._catch_up(requests, seqs, hidden, result.tokens, result.accepted, cells, starts_at, q, exact, counted)
        # The host gets `accepted` per position row (emitted is accepted + 1), in the packed copy.
        accepted = result.accepted.unsqueeze(1).expand(-1, q).reshape(-1, 1)
        host = HostCopy(torch.cat([pack(result.sampled), accepted], dim=1))
        launched = LaunchedSpecStep(requests, lens, q, host, result.sampled.top_counts, starts, result.tokens,
                                    result.emitted, result.accepted)
        self._unread.append(launched)
        return launched

    def run(self, requests: Sequence[SpecRequest], ahead: bool, max_steps: int | None = None,
            num_steps: int | None = None, policy: SpeculationPolicy | None = None) -> SpecRun:
        """Steps until every request is done (or `max_steps` are launched). With `ahead` step N+1 is
        launched before step N is read whenever `can_launch_ahead` allows (the steady state), so the
        host builds N+1 while the device runs N; when the rows change, the step in flight is read
        before the next launch (a row change needs the host's counts). Each step drafts `num_steps`
        (default: the configured number; never more), or with `policy` `policy.steps_for(rows)`, and
        then each read step's accepted and rejected drafts update the policy's accept rate."""
        running, pending, run = [r for r in requests if not r.finished], None, SpecRun()

        def read(step: LaunchedSpecStep) -> None:
            before = (self.stats.accepted, self.stats.rejected)
            self.finish(step)
            if policy is not None:
                policy.rate.observe(self.stats.accepted - before[0], self.stats.rejected - before[1])

        while running and (max_steps is None or len(run.lens) < max_steps):
            if pending is not None and not (ahead and self.can_launch_ahead(running, pending)):
                read(pending)
                pending = None
            else:
                steps = num_steps if policy is None else policy.steps_for(len(running))
                launched = self.launch(running, steps, after=pending)
                if launched is not None:
                    run.lens.append(launched.lens)
                    run.requested.append(self.num_steps if steps is None else min(steps, self.num_steps))
                    run.launched_ahead += pending is not None
                if pending is not None:
                    read(pending)
                pending = launched if ahead else None
                if not ahead and launched is not None:
                    read(launched)
            running = [r for r in running if not r.finished]
        if pending is not None:  # its rows all ended in the step before it, or max_steps was reached
            read(pending)
        return run

    def can_launch_ahead(self, requests: Sequence[SpecRequest], after: LaunchedSpecStep) -> bool:
        """Whether the next step of `requests` can be launched before `after` is read: `after` is the
        only step not yet read (the host's lengths are exact up to where it starts), the same rows
        (the unfinished `requests` are `after`'s, in order: the sampling batch's device state is kept
        by row, and a row that leaves writes back host counts the host does not have yet), and
        forwards that take their lengths from the device (`SpeculativeForwards.needs_host_lengths`)."""
        rows = [id(r) for r in requests if not r.finished]
        only_unread = len(self._unread) == 1 and self._unread[0] is after
        return (only_unread and rows == [id(r) for r in after.requests] and self.pad_catch_up
                and not self.runner.spec_forwards.needs_host_lengths)

    def finish(self, launched: LaunchedSpecStep, void: Collection[int] = ()) -> list[int]:
        """The step's one host read; each request's tokens through `emit`, in order, up to a stop.
        Returns how many tokens each row got. `void`: ids of requests that ended before this step in
        a way only the caller knows (a stop token or string found when the step before it was
        streamed; the decode worker's rows end by budget alone): their rows are void as a finished
        request's are, so they count in no stats."""
        self._unread = [step for step in self._unread if step is not launched]
        host, q = launched.host.wait(), launched.q
        sampled = unpack(host[:, :-1], launched.top_counts)
        got = []
        counts = host[::q, -1].long().tolist()  # accepted per row
        for i, (request, drafted, accepted) in enumerate(zip(launched.requests, launched.lens, counts)):
            emitted = accepted + 1
            self.sampling.advanced(request.sampling, emitted)  # before `emit` acknowledges the tokens
            if request.finished or id(request) in void:  # it ended in the step this one was launched ahead of
                got.append(0)
                self._drafts.pop(id(request), None)
                continue
            n = 0
            while n < emitted and not request.finished:
                row = i * q + n
                self.emit(request, sampled.token_ids[row], sampled.logprobs[row], sampled.top[row])
                n += 1
            self.stats.add(drafted, min(accepted, n), n)
            got.append(n)
            if request.finished:
                self._drafts.pop(id(request), None)
        return got

    def seed(self, request: SpecRequest, token: int, hidden: torch.Tensor) -> None:
        """Its first draft, from an MTP pass over its prompt that ran elsewhere (`mtp_over_extend`,
        in a colocated prefill round or on the prefill worker)."""
        self._drafts[id(request)] = _Draft(self._upload([token]), hidden.unsqueeze(0), 0)

    def forget(self, request: SpecRequest) -> None:
        """Drops a request's draft state (it ended, by a stop, an abort or a failure); its sampling
        row leaves at the next `launch` (this may run on another thread than the steps)."""
        self._drafts.pop(id(request), None)

    def reset(self) -> None:
        """After a failed step, whose requests all fail: the sampling batch's device state can no
        longer be trusted, so a new one starts (their drafts go with `forget`, as they end)."""
        self.sampling = SamplingBatch(self.sampling.vocab_size, self.device, self.sampling.fallback_generator)
        self._unread.clear()

    def _counted_tokens(self, requests: list[SpecRequest], after: LaunchedSpecStep,
                        lens: list[int]) -> torch.Tensor | None:
        """`[T]` long over the verify's tokens (row i's k_i + 1): 0 for a void row's, 1 for the rest,
        so that the expert load counts what a run without launching ahead would (`ForwardBatch.counted_tokens`).
        A row is void when `after` brings its output to max_new: known only on the device here. Such
        a row drafts nothing (its bound is past its budget), so its chain has no tokens to mask.
        None when no expert load is recorded (nothing reads it)."""
        if self.runner.expert_load is None:
            return None
        ends = self._upload([len(r.prompt_ids) + r.max_new - 1 for r in requests])
        live = (after.starts.starts + after.emitted < ends).long()  # [B]: its request goes on
        if min(lens) == max(lens):
            return live.repeat_interleave(lens[0] + 1)
        return live.index_select(0, self._upload([i for i, k in enumerate(lens) for _ in range(k + 1)]))

    def _padding_pages(self) -> list[int] | None:
        """What a padded verify row's positions past its own pages write into (the graphs' scratch
        page, as often as the most drafts can reach past a page), or None: rows verify only their
        own drafts. Padding pays only where a verify graph replays it: runners without one (eager,
        EP groups), recording an expert load (which the pad tokens must not enter, and which
        graphs never replay) or under attention TP (whose followers replay eagerly) do not pad."""
        forwards = self.runner.spec_forwards
        graphs = forwards.graphs
        if (graphs is None or not graphs.verify_graphs or self.runner.expert_load is not None
                or forwards.tp_replay is not None):
            return None
        return [graphs.scratch_page] * self.runner.kv_pool.pages_for_tokens(self.num_steps)

    def _graph_width(self, tokens: int) -> int:
        """Tokens per row of the narrowest captured verify graph that holds `tokens` (`tokens` itself
        where none does: then the verify runs eagerly whatever its width)."""
        captured = [q for q in self.runner.spec_forwards.graphs.verify_graphs if q >= tokens]
        return min(captured, default=tokens)

    def _verify_pages(self, pages: list[int], end: int, padding: list[int] | None) -> list[int]:
        """A verify row's pages for positions up to `end` (exclusive): its own, then `padding` where
        a padded row reaches past them (its real positions never do: `draft_len`)."""
        if padding is None or end <= len(pages) * self.runner.kv_pool.page_size:
            return pages
        return [*pages, *padding]

    def _arange(self, n: int) -> torch.Tensor:
        """`arange(n)` on the device, made once per n."""
        if n not in self._aranges:
            self._aranges[n] = torch.arange(n, device=self.device)
        return self._aranges[n]

    def _upload(self, values: list[int]) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=torch.long), self.device)

    def _sync_rows(self, states: list[SamplingState]) -> None:
        """The sampling batch's rows become `states`, in order (rows that left write their state back)."""
        if [id(s) for s in self.sampling.states] == [id(s) for s in states]:
            return
        self.sampling.remove(self.sampling.states)
        for state in states:
            self.sampling.add(state)

    def _chain(self, requests: list[SpecRequest], starts: FuturePositions, future: bool, lens: list[int],
               width: int) -> torch.Tensor:
        """`[B, width]` long: each request's draft tokens (d1 from the last catch-up, then k-1 MTP
        decode steps, argmax), -1 past its `lens`; on the device. `future`: `starts` are exact only
        on the device."""
        batch = len(requests)
        rows = [i for i, k in enumerate(lens) if k]
        if not rows:
            return torch.full((batch, width), -1, dtype=torch.long, device=self.device)
        tokens, hidden = self._draft_inputs([requests[i] for i in rows])
        columns = [self._column(tokens, rows, batch)]
        for j in range(1, max(lens)):
            longer = [n for n, i in enumerate(rows) if lens[i] > j]  # among `rows`
            if len(longer) < len(rows):  # some rows stop drafting here
                keep = self._upload(longer)
                rows = [rows[n] for n in longer]
                tokens, hidden = tokens.index_select(0, keep), hidden.index_select(0, keep)
            seqs = [ExtendSeq([0], prefix_len=starts.bounds[i] + j - 1, pages=requests[i].pages) for i in rows]
            at = None
            if future:
                at = starts.starts if len(rows) == batch else starts.starts.index_select(0, self._upload(rows))
                at = at + (j - 1) if j > 1 else at
            hidden = self.runner.draft(seqs, hidden, input_ids=tokens, starts=at)
            tokens = self.runner.logits(hidden).argmax(dim=-1)
            columns.append(self._column(tokens, rows, batch))
        drafts = torch.stack(columns, dim=1)
        if drafts.shape[1] < width:  # a verify wider than any row's drafts (`_graph_width`)
            drafts = torch.cat([drafts, drafts.new_full((batch, width - drafts.shape[1]), -1)], dim=1)
        return drafts

    def _draft_inputs(self, requests: list[SpecRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """`requests`' d1 `[N]` and MTP hidden states `[N, H]`: the last catch-up's tensors as they
        are when these are its rows in order (the common step), else gathered row by row."""
        drafts = [self._drafts[id(r)] for r in requests]
        first = drafts[0]
        if first.tokens.shape[0] == len(drafts) and all(d.tokens is first.tokens and d.row == i
                                                         for i, d in enumerate(drafts)):
            return first.tokens, first.hidden
        return (torch.stack([d.tokens[d.row] for d in drafts]), torch.stack([d.hidden[d.row] for d in drafts]))

    def _column(self, tokens: torch.Tensor, rows: list[int], batch: int) -> torch.Tensor:
        """`[batch]`: `tokens` at `rows`, -1 elsewhere."""
        if len(rows) == batch:
            return tokens
        column = torch.full((batch,), -1, dtype=torch.long, device=self.device)
        return column.index_copy_(0, self._upload(rows), tokens)

    def _catch_up(self, requests: list[SpecRequest], seqs: list[ExtendSeq], hidden: torch.Tensor,
                  tokens: torch.Tensor, accepted: torch.Tensor, cells: torch.Tensor | None, starts: list[int],
                  q: int, exact: torch.Tensor | None, counted: torch.Tensor | None = None) -> None:
        """MTP over (emitted token, target hidden) pairs at every verify position (the emitted
        tokens, then the last one again: module docstring); each next d1 from its last emitted row
        (row `accepted`: a row emits accepted + 1). `cells` None: every row verified q tokens.
        `counted`: the verify's, whose token layout the padded catch-up keeps."""
        uniform = cells is None
        if not self.pad_catch_up:  # the reference: only the emitted tokens (reads their counts)
            counts = (accepted + 1).tolist()
            uniform = False
            keep = [start + j for start, n in zip(starts, counts) for j in range(n)]
            seqs = [ExtendSeq([0] * n, s.prefix_len, s.pages) for s, n in zip(seqs, counts)]
            hidden = hidden.index_select(0, self._upload(keep))
            cells = self._upload([i * q + j for i, n in enumerate(counts) for j in range(n)])
            starts = [0]
            for n in counts:
                starts.append(starts[-1] + n)
        column = torch.minimum(self._arange(q).unsqueeze(0), accepted.unsqueeze(1))
        ids = tokens.gather(1, column).reshape(-1)
        if cells is not None:
            ids = ids.index_select(0, cells)
        out = self.runner.draft(seqs, hidden, input_ids=ids, starts=exact, counted=counted)
        if uniform:  # row i's last emitted token is out row i * q + accepted[i]
            width = out.shape[-1]
            out = out.view(len(requests), q, width).gather(1, accepted.view(-1, 1, 1).expand(-1, 1, width)).squeeze(1)
        else:
            out = out.index_select(0, self._upload(starts[:-1]) + accepted)
        next_tokens = self.runner.logits(out).argmax(dim=-1)
        for i, request in enumerate(requests):
            self._drafts[id(request)] = _Draft(next_tokens, out, i)


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
    ends, total = [], 0
    for s in seqs:
        total += len(s.token_ids)
        ends.append(total)
    last = out[upload(torch.tensor([ends[i] - 1 for i in rows], dtype=torch.long), out.device)]
    tokens = runner.logits(last).argmax(dim=-1).tolist()
    return list(zip(tokens, last))
