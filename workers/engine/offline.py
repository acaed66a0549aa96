"""The offline engine: one process, one `ModelRunner`, prompts in, tokens out. No PD, no server.

It is the reference the serving tests compare against, so it takes the same path a worker does:
the prompt is validated, then prefilled by the workers' own rounds (workers/engine/prefill_round.py)
in chunks of at most `chunked_prefill_size` tokens per forward (a later chunk is an extend whose
prefix is already in the paged cache, which is how MHA_CHUNKED_KV and MLA-over-prefix get
exercised), then decoded one token per step over the paged latent cache, every request of a batch
in the same forward. Pages are freed however the call ends.

    engine = Engine("tiny")
    result = engine.generate("Hello", SamplingParams(temperature=0.0, max_new_tokens=8))
    result.output_ids, result.text, result.finish_reason   # [...], "...", "length"
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence, Union

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.request_rules import check_prompt, kv_tokens_needed, max_new_tokens
from deepseek_pd.model.sampling.sampled_host import TopLogprobs, pack, unpack
from deepseek_pd.model.sampling.sampler import Sampler, SamplingState, StopChecker
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.speculative.rules import check_speculative_num_steps
from deepseek_pd.workers.engine.prefill_round import FirstToken, PrefillRounds, RoundHooks

Prompt = Union[str, Sequence[int]]


@dataclass(frozen=True)
class EngineConfig:
    """What the offline engine runs, resolved before the runner is built."""

    model: str = "tiny"  # checkpoint directory, or "tiny" / "tiny-v2"
    dtype: str = "auto"  # auto (fp32 on CPU, checkpoint dtype on GPU) | float32 | bfloat16 | float16
    device: str = "cpu"
    attention_method: str = "auto"  # auto | mha | mha_chunked_kv | mla
    chunked_prefill_size: int = 2048  # max prompt tokens per prefill forward, summed over the batch
    page_size: int | None = None  # None: the machine's default (model/kv/page_size.py: 64 where FlashMLA runs, else 16)
    max_total_tokens: int = 32768  # KV pool capacity in tokens, over all requests of a batch
    mha_chunked_kv_threshold: int = 256
    attention_backend: str = "auto"  # auto: triton on CUDA when it imports, else torch
    moe_backend: str = "auto"  # auto | torch | triton | grouped
    cuda_graph: bool = False  # decode by CUDA-graph replay (needs CUDA and the triton/grouped backends)
    # Draft tokens per decode step from the checkpoint's MTP layer (model/speculative/decoder.py); 0: off.
    speculative_num_steps: int = 0
    # Launch each speculative step before the previous one is read (its positions from the device:
    # model/speculative/future_positions.py); False: launch, read, launch (the reference order).
    # On by default (the decode worker's is still off: scheduler_config.py): its GPU test
    # (tests/model/speculative/test_speculative_sync_gpu.py) passed on an H100 on 2026-12-07.
    speculative_overlap: bool = True
    # Draft 0..speculative_num_steps per step by batch size, from step costs measured when the engine
    # is built and the accept rate so far (model/speculative/policy.py), as the decode worker's
    # `speculative_adaptive`; off: always speculative_num_steps.
    speculative_adaptive: bool = False
    # Batch-invariant forward and chunk cuts aligned to chunked_prefill_size (docs/deterministic.md).
    deterministic: bool = False
    enable_tbo: bool = False  # two-batch overlap (model/distributed/tbo.py): each forward as two micro-batches

    def __post_init__(self) -> None:
        check_speculative_num_steps(self.speculative_num_steps)
        if self.speculative_adaptive and not self.speculative_num_steps:
            raise UserError("speculative_adaptive chooses among 0..speculative_num_steps drafts: "
                            "set speculative_num_steps >= 1 with it")
        if self.chunked_prefill_size < 1:
            raise UserError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.max_total_tokens < 1 or (self.page_size is not None and self.page_size < 1):
            raise UserError(f"max_total_tokens and page_size must be >= 1, got {self.max_total_tokens}, "
                            f"{self.page_size}")


@dataclass
class GenerateResult:
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    matched_stop: Union[int, str, None] = None
    prompt_tokens: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    # Per output token with `SamplingParams.top_logprobs_num` > 0 (else empty), most likely first.
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)


@dataclass
class _Request:
    """One prompt's progress through prefill and decode."""

    prompt_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    stop: StopChecker
    pages: list[int]
    max_new: int = 0  # the output budget, capped by the context
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # What a prefill round asks of its owners (prefill_round.RoundOwner): a wave never ends early.
    ended: bool = False
    in_flight: int = 0

    @property
    def finished(self) -> bool:
        return self.stop.finish is not None


class Engine:
    def __init__(self, model: str | Path = "tiny", *, config: EngineConfig | None = None, **overrides) -> None:
        """`Engine("tiny", chunked_prefill_size=64)` or `Engine(config=EngineConfig(...))`."""
        from deepseek_pd.model.runner import ModelRunner
        from deepseek_pd.model.config import ModelConfig
        from deepseek_pd.model.runner_config import RunnerConfig, default_page_size
        from deepseek_pd.model.device import resolve_device
        from deepseek_pd.model.checkpoint.model_dir import load_tokenizer, resolve_model_dir

        if config is None:
            config = EngineConfig(model=str(model), **overrides)
        elif overrides:
            raise TypeError("pass either config or keyword overrides, not both")
        device = resolve_device(config.device)
        self.model_path = resolve_model_dir(config.model)
        if config.page_size is None:
            config = replace(config, page_size=default_page_size(ModelConfig.from_hf(self.model_path), device,
                                                                 config.dtype))
        self.config = config
        self.runner = ModelRunner(RunnerConfig(
            model=str(self.model_path), dtype=config.dtype, device=device,
            page_size=config.page_size, num_pages=-(-config.max_total_tokens // config.page_size),
            attention_method=config.attention_method, mha_chunked_kv_threshold=config.mha_chunked_kv_threshold,
            attention_backend=config.attention_backend, moe_backend=config.moe_backend,
            cuda_graph=config.cuda_graph, speculative_num_steps=config.speculative_num_steps,
            speculative_adaptive=config.speculative_adaptive, deterministic=config.deterministic,
            enable_tbo=config.enable_tbo))
        self.model_config = self.runner.model_config
        self.tokenizer = load_tokenizer(self.model_path)
        self.sampler = Sampler()
        self.speculative = None
        self.speculation_policy = None  # with speculative_adaptive (model/speculative/policy.py)
        if config.speculative_num_steps:
            from deepseek_pd.model.speculative.decoder import SpeculativeDecoder
            from deepseek_pd.model.speculative.step_costs import calibrated_policy

            self.speculative = SpeculativeDecoder(self.runner, config.speculative_num_steps, _record,
                                                  self.sampler.fallback_generator)
            if config.speculative_adaptive:
                self.speculation_policy = calibrated_policy(self.runner, config.speculative_num_steps,
                                                            self.runner.config.cuda_graph_max_batch)
        # What the next calls draft (`set_speculation`); the last call's speculative steps (`SpecRun`).
        self._drafts_per_step = config.speculative_num_steps
        self._adaptive = config.speculative_adaptive
        self.last_speculative_run = None
        self.rounds = PrefillRounds(self.runner, self.sampler, config.chunked_prefill_size, _Recorder(self),
                                    aligned=config.deterministic)

    # ---- public API --------------------------------------------------------------------------
    def set_speculation(self, num_steps: int, adaptive: bool = False) -> None:
        """Drafts per step for the calls that follow, on the model as built: 0 decodes plainly, 1..the
        configured `speculative_num_steps` drafts that many, `adaptive` lets the start-up policy pick
        0..num_steps per step (built with `speculative_adaptive`). One loaded model, several settings
        (bench/mtp_trained_gpu.py compares them)."""
        check_speculative_num_steps(num_steps)
        if num_steps > self.config.speculative_num_steps:
            raise UserError(f"{num_steps} drafts per step, but the engine was built for at most "
                            f"speculative_num_steps={self.config.speculative_num_steps}")
        if adaptive and (self.speculation_policy is None or not num_steps):
            raise UserError("adaptive drafting needs an engine built with speculative_adaptive and num_steps >= 1")
        self._drafts_per_step, self._adaptive = num_steps, adaptive

    @property
    def speculating(self) -> bool:
        """Whether the next calls draft (`set_speculation`)."""
        return bool(self._drafts_per_step)

    @property
    def max_context(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def encode(self, text: str) -> list[int]:
        """Text to ids with special tokens added (the tokenizer's post-processor prepends BOS), as
        HF `tokenizer(text)` does."""
        if self.tokenizer is None:
            raise UserError(f"{self.model_path} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerateResult:
        return self.generate_batch([prompt], params)[0]

    def generate_batch(self, prompts: Sequence[Prompt],
                       params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerateResult]:
        """Prefills and then decodes the prompts together; results in prompt order.

        Prompts whose KV does not fit the pool at once run in consecutive waves (no continuous
        batching: a wave finishes before the next starts)."""
        if not prompts:
            raise UserError("no prompts given")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(params)} sampling params")
        prompt_ids = [self._validate_prompt(p, f"prompt {i}: " if len(prompts) > 1 else "")
                      for i, p in enumerate(prompts)]
        for p in params:
            p.validate(vocab_size=self.vocab_size)
        results: list[GenerateResult] = []
        for wave in self._waves(prompt_ids, params):
            results += self._run_wave([prompt_ids[i] for i in wave], [params[i] for i in wave])
        return results

    def _waves(self, prompt_ids: list[list[int]], params: Sequence[SamplingParams]) -> list[list[int]]:
        """Consecutive groups of request indices whose KV fits the pool together (a request that
        cannot fit even alone is refused before anything runs)."""
        pool = self.runner.kv_pool
        waves: list[list[int]] = [[]]
        free = pool.num_free_pages
        for i, (ids, p) in enumerate(zip(prompt_ids, params)):
            need = pool.pages_for_tokens(kv_tokens_needed(len(ids), self._max_new_tokens(ids, p)))
            if need > pool.num_free_pages:
                where = f"prompt {i}: " if len(prompt_ids) > 1 else ""
                raise UserError(f"{where}{len(ids)} prompt tokens + {p.max_new_tokens} new tokens need {need} KV "
                                f"pages but the pool has {pool.num_free_pages} free of {pool.num_pages} "
                                f"(raise max_total_tokens)")
            if need > free:
                waves.append([])
                free = pool.num_free_pages
            waves[-1].append(i)
            free -= need
        return waves

    def _run_wave(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[GenerateResult]:
        requests: list[_Request] = []
        try:
            for ids, p in zip(prompt_ids, params):
                requests.append(self._admit(ids, p))
            self._prefill(requests)
            self._decode(requests)
        finally:
            for request in requests:
                self.runner.kv_pool.free(request.pages)
        return [GenerateResult(output_ids=r.output_ids, text=r.stop.text, finish_reason=r.stop.finish.reason,
                               matched_stop=r.stop.finish.matched_stop, prompt_tokens=len(r.prompt_ids),
                               output_logprobs=r.logprobs, output_top_logprobs=r.top_logprobs)
                for r in requests]

    # ---- steps ------------------------------------------------------------------------------
    def _validate_prompt(self, prompt: Prompt, where: str) -> list[int]:
        if isinstance(prompt, str) and not prompt:
            raise UserError(f"{where}prompt is empty")
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            # numpy and other integer types are fine; bools and floats are not token ids
            ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in ids]
        check_prompt(ids, self.vocab_size, self.max_context, where)
        return ids

    def _max_new_tokens(self, prompt_ids: list[int], params: SamplingParams) -> int:
        return max_new_tokens(params, len(prompt_ids), self.max_context)

    def _admit(self, prompt_ids: list[int], params: SamplingParams) -> _Request:
        # The cache holds one token fewer than prompt + output: the last sampled token is never fed back.
        max_new = self._max_new_tokens(prompt_ids, params)
        pool = self.runner.kv_pool
        pages = pool.alloc(pool.pages_for_tokens(kv_tokens_needed(len(prompt_ids), max_new)))
        device = self.runner.model.options.device
        return _Request(
            prompt_ids=prompt_ids, params=params, pages=pages, max_new=max_new,
            sampling=SamplingState.create(params, prompt_ids, self.vocab_size, device=device),
            stop=StopChecker(params, self.model_config.eos_token_ids, self.tokenizer, max_new_tokens=max_new))

    def _prefill(self, requests: list[_Request]) -> None:
        """Rounds of at most `chunked_prefill_size` tokens, planned and run as the workers run them."""
        pending = [self.rounds.start(r, r.prompt_ids, r.pages) for r in requests]
        while pending:
            self.rounds.run(pending)
            pending = [item for item in pending if item.remaining > 0]

    def _decode(self, requests: list[_Request]) -> None:
        from deepseek_pd.model.runner import DecodeSeq

        running = [r for r in requests if not r.finished]
        if self.speculating:
            self._speculate(running)
            running = []
        while running:
            seqs = [DecodeSeq(r.output_ids[-1], position=len(r.prompt_ids) + len(r.output_ids) - 1, pages=r.pages)
                    for r in running]
            self._sample(running, self.runner.decode(seqs))
            running = [r for r in running if not r.finished]

    def _speculate(self, running: list[_Request]) -> None:
        """Speculative steps until every request is done; with `speculative_overlap` each is launched
        before the one ahead of it is read, wherever the rows allow (SpeculativeDecoder.run); with
        `speculative_adaptive` each drafts as many as the policy picks for the batch."""
        policy = self.speculation_policy if self._adaptive else None
        self.last_speculative_run = self.speculative.run(running, ahead=self.config.speculative_overlap,
                                                         num_steps=self._drafts_per_step, policy=policy)

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> None:
        out = self.sampler.sample(logits, [r.sampling for r in requests])
        sampled = unpack(pack(out).cpu(), out.top_counts)
        for request, token, logprob, top in zip(requests, sampled.token_ids, sampled.logprobs, sampled.top):
            _record(request, token, logprob, top)


def _record(request: _Request, token: int, logprob: float, top: TopLogprobs | None) -> None:
    """A sampled output token joins the request (its sampler already advanced its state)."""
    request.output_ids.append(token)
    request.logprobs.append(logprob)
    if top is not None:
        request.top_logprobs.append(top)
    request.sampling.append(token)
    request.stop.append(token)


class _Recorder(RoundHooks[_Request]):
    """The offline engine's side of a prefill round: first tokens (and first drafts) are recorded."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def first_token(self, owner: _Request, first: FirstToken) -> None:
        _record(owner, first.token_id, first.logprob, first.top)
        if first.draft is not None and self.engine.speculating:  # else this call decodes plainly
            self.engine.speculative.seed(owner, *first.draft)
