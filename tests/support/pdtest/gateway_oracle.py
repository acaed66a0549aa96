"""Oracles and raw HTTP helpers for tests that go through the real gateway (smg).

- `offline_greedy`: the offline single-process `Engine`'s greedy tokens and logprobs for a prompt.
- `reference_logprobs`: an independent log-softmax, one full forward of prompt + output prefix per
  position on the offline engine's runner (no sampler involved), with each position's top-k.
- `chat_prompt_ids`: the token ids a chat request's messages become (the tokenizer's chat template,
  which the router renders the same way); `random_words`: a fresh prompt text per run.
- `same_text`: whether the gateway's text is the offline tokens' text.
- `post_json` / `post_stream`: one HTTP call with its status and parsed body or SSE events, so a
  test sees exactly what a client gets (status codes, error bodies, events) without a client
  library smoothing it over.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdtest.e2e_cluster import CHUNKED_PREFILL_SIZE, PAGE_SIZE


def offline_engine():
    from deepseek_pd.workers.engine.offline import Engine

    return Engine(model="tiny", chunked_prefill_size=CHUNKED_PREFILL_SIZE, page_size=PAGE_SIZE)


def offline_greedy(engine, input_ids: list[int], max_new_tokens: int, ignore_eos: bool = True):
    """(output ids, their logprobs) of greedy decoding on the offline engine."""
    from deepseek_pd.model.sampling.params import SamplingParams

    result = engine.generate(input_ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                       ignore_eos=ignore_eos))
    return list(result.output_ids), list(result.output_logprobs)


def offline_greedy_batch(engine, prompts: list[list[int]], max_new: list[int], ignore_eos: bool = True) -> list[list[int]]:
    """Each prompt's greedy output ids, as `offline_greedy` gives them, from one batch of the offline
    engine: as many decode steps as the longest answer, not their sum (a request's greedy tokens do
    not depend on its batch here, as every cluster test's batched decode against this oracle shows)."""
    from deepseek_pd.model.sampling.params import SamplingParams

    results = engine.generate_batch(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=ignore_eos)
                                              for n in max_new])
    return [list(r.output_ids) for r in results]


def chat_prompt_ids(hf_tokenizer, messages: list[dict]) -> list[int]:
    """The prompt the gateway builds from `messages`: the chat template with the generation prompt."""
    return list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))


def random_words(rng: random.Random, n: int) -> str:
    words = ["disaggregated", "prefill", "decode", "latent", "cache", "router", "expert", "page", "token"]
    return " ".join(rng.choice(words) for _ in range(n)) + f" {rng.randrange(10**6)}"


def same_text(got: str, want_ids: list[int], engine) -> bool:
    """The gateway's text equals the offline tokens' text. Random tokens of a byte-level BPE often
    split a UTF-8 character; smg's incremental detokeniser holds back a split tail and replaces
    broken bytes its own way, so U+FFFD is left out on both sides: every valid character must match."""
    want = engine.tokenizer.decode(want_ids, skip_special_tokens=True)
    return got.replace("\ufffd", "") == want.replace("\ufffd", "")


@dataclass
class PositionLogprobs:
    chosen: float  # log-softmax of the token that was actually generated at this position
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), most likely first


def reference_logprobs(engine, prompt: list[int], output: list[int], k: int,
                       temperature: float = 1.0) -> list[PositionLogprobs]:
    """log_softmax of the model's next-token logits / `temperature` (1: greedy requests) before each
    output token: the distribution the workers report the sampled and top logprobs under."""
    import torch

    from deepseek_pd.model.runner import ExtendSeq

    runner = engine.runner
    pool = runner.kv_pool
    rows = []
    for i, token in enumerate(output):
        context = prompt + output[:i]
        pages = pool.alloc(pool.pages_for_tokens(len(context)))
        try:
            logits = runner.extend([ExtendSeq(context, prefix_len=0, pages=pages)])[0]
        finally:
            pool.free(pages)
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        values, ids = torch.topk(logp, k)
        rows.append(PositionLogprobs(float(logp[token]), list(zip(ids.tolist(), values.tolist()))))
    return rows


@dataclass
class Reply:
    status: int
    body: Any = None  # parsed JSON (non-streamed, or an error body)
    text: str = ""
    events: list[dict] = field(default_factory=list)  # SSE data events, in order (streamed)
    done: bool = False  # the stream ended with `data: [DONE]`

    def error_message(self) -> str:
        body = self.body
        if isinstance(body, dict):
            error = body.get("error", body)
            if isinstance(error, dict):
                return str(error.get("message", error))
            return str(error)
        return self.text


async def post_json(session: aiohttp.ClientSession, url: str, body: Any, **kwargs) -> Reply:
    async with session.post(url, json=body, **kwargs) as response:
        text = await response.text()
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        return Reply(response.status, parsed, text)


async def post_stream(session: aiohttp.ClientSession, url: str, body: Any) -> Reply:
    """A streamed call; a non-200 answer comes back with its body and no events."""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            text = await response.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            return Reply(response.status, parsed, text)
        reply = Reply(response.status)
        async for raw in response.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                reply.done = True
                continue
            reply.events.append(json.loads(data))  # a malformed event fails the test here
        return reply
