"""What a user gets through the REAL gateway (PyPI smg 1.13) in front of real tiny-model workers.

One 1P2D cluster (`up`'s LocalCluster) serves the module. The oracles are the offline
single-process Engine (greedy tokens) and an independent log-softmax of full forwards on its runner
(logprobs). What must hold, and what smg 1.13 does (read in its source, lightseekorg/smg,
crates/grpc_client/src/sglang_scheduler.rs and model_gateway/src/routers/grpc/):

- `/generate`, `/v1/completions` and `/v1/chat/completions`, streamed and not, give the offline
  engine's greedy tokens; sampled-token logprobs (`return_logprob`, chat `logprobs: true`) equal the
  offline log-softmax (chat reports them per text piece, so a token split inside a UTF-8 character
  may have none). (`/v1/completions` drops logprobs from its answer in smg 1.13.)
- `n > 1`: smg fans the request out as n single-sample requests, one PD pair each; every choice
  is complete and, greedy, equal to the offline tokens.
- top logprobs (chat `top_logprobs`, completions `logprobs: k`, /generate `top_logprobs_num`, up to
  20) are computed by the workers (the first token's by prefill, carried in TransferDone) and equal
  the offline log-softmax's k largest; smg 1.13 shows them only in chat answers, per text piece
  (`/generate` drops them from meta_info, `/v1/completions` drops all logprobs). Over 20: smg
  refuses chat itself (400 `top_logprobs`), a worker refuses /generate (400 naming
  `top_logprobs_num`); prompt logprobs (`logprob_start_len` >= 0) are a 400 naming it.
- `seed`: smg builds SGLang's SamplingParams without it (that proto has no seed field; our
  workers read `custom_params.seed`, which smg never fills), so through smg 1.13 same-seed requests
  are NOT reproducible. Sent straight to the workers it is honoured, on either decode worker.
- bad input gets a 4xx naming the field, from smg itself (422/400 for a negative budget, 400 for a
  temperature out of range, 400 for a prompt over the context, 404 for an unknown model, 413 for a
  body over --max-payload-size) or from a worker (400 carrying our INVALID_ARGUMENT message), and a
  good stream running at the same time completes with the right tokens.
"""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.client.pd_dispatch import PDClient
from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect, sampling_proto
from deepseek_pd.gateway import MAX_PAYLOAD_BYTES
from deepseek_pd.launcher.cluster import LocalCluster
from deepseek_pd.model.sampling.params import MAX_TOP_LOGPROBS
from pdtest.e2e_cluster import cluster_spec, wait_for_pages
from pdtest.gateway_oracle import (
    chat_prompt_ids, offline_engine, offline_greedy, post_json, post_stream, random_words, reference_logprobs, same_text)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

LOGPROB_TOL = 2e-3  # fp32 on CPU: paged decode vs one full forward differ in summation order


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(cluster_spec(tmp_path_factory.mktemp("gateway-api"), num_decode=2)) as running:
        yield running


@pytest.fixture(scope="module")
def engine():
    return offline_engine()


@pytest.fixture(scope="module")
def hf_tokenizer(cluster):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cluster.model_dir))


def completion_ids(engine, text: str) -> list[int]:
    """smg 1.13 tokenises a /v1/completions prompt without special tokens (no BOS)."""
    return engine.tokenizer.encode(text, add_special_tokens=False).ids


def run(coro):
    return asyncio.run(coro)


async def session_call(fn):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as session:
        return await fn(session)


def test_generate_streamed_and_not_matches_offline_logprobs(cluster, engine) -> None:
    rng = random.Random()
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(5, 70))]
    max_new = rng.randint(4, 10)
    want, _ = offline_greedy(engine, prompt, max_new)
    reference = reference_logprobs(engine, prompt, want, k=1)
    body = {"model": cluster.served_model_name, "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}

    async def main(session):
        whole = await post_json(session, f"{cluster.router_url}/generate", {**body, "stream": False})
        streamed = await post_stream(session, f"{cluster.router_url}/generate", {**body, "stream": True})
        return whole, streamed

    whole, streamed = run(session_call(main))
    assert whole.status == 200, whole.text
    item = whole.body[0] if isinstance(whole.body, list) else whole.body
    assert item["output_ids"] == want
    got = [entry[0] for entry in item["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx([r.chosen for r in reference], abs=LOGPROB_TOL)
    assert streamed.status == 200 and streamed.events, streamed.text
    ids = [t for event in streamed.events for t in event.get("output_ids") or []]
    assert ids == want


@pytest.mark.parametrize("stream", [False, True])
def test_completions_give_the_offline_engines_text(cluster, engine, stream: bool) -> None:
    rng = random.Random()
    text = random_words(rng, rng.randint(3, 12))
    prompt = completion_ids(engine, text)
    max_new = rng.randint(4, 10)
    want, _ = offline_greedy(engine, prompt, max_new)
    body = {"model": cluster.served_model_name, "prompt": text, "max_tokens": max_new, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}

    async def main(session):
        url = f"{cluster.router_url}/v1/completions"
        return await (post_stream(session, url, body) if stream else post_json(session, url, body))

    reply = run(session_call(main))
    assert reply.status == 200, reply.text
    if stream:
        assert reply.done, "a completions stream ends with [DONE]"
        got = "".join(choice.get("text") or "" for e in reply.events for choice in e.get("choices") or [])
        reasons = [c.get("finish_reason") for e in reply.events for c in e.get("choices") or [] if c.get("finish_reason")]
    else:
        got = reply.body["choices"][0]["text"]
        reasons = [reply.body["choices"][0]["finish_reason"]]
        assert reply.body["usage"] == {**reply.body["usage"], "prompt_tokens": len(prompt), "completion_tokens": max_new}
    assert same_text(got, want, engine), (got, engine.tokenizer.decode(want))
    assert reasons == ["length"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_match_offline_tokens_and_logprobs(cluster, engine, hf_tokenizer, stream: bool) -> None:
    rng = random.Random()
    messages = [{"role": "user", "content": random_words(rng, rng.randint(2, 10))}]
    prompt = list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))
    max_new = rng.randint(3, 8)
    want, _ = offline_greedy(engine, prompt, max_new)
    reference = reference_logprobs(engine, prompt, want, k=1)
    body = {"model": cluster.served_model_name, "messages": messages, "max_tokens": max_new,
            "temperature": 0.0, "ignore_eos": True, "logprobs": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}

    async def main(session):
        url = f"{cluster.router_url}/v1/chat/completions"
        return await (post_stream(session, url, body) if stream else post_json(session, url, body))

    reply = run(session_call(main))
    assert reply.status == 200, reply.text
    if stream:
        choices = [c for e in reply.events for c in e.get("choices") or []]
        content = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
        logprobs = [entry["logprob"] for c in choices for entry in ((c.get("logprobs") or {}).get("content") or [])]
        usage = next(e["usage"] for e in reversed(reply.events) if e.get("usage"))
    else:
        choice = reply.body["choices"][0]
        content = choice["message"]["content"]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        usage = reply.body["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == max_new
    assert same_text(content, want, engine), (content, engine.tokenizer.decode(want))
    want_logprobs = [r.chosen for r in reference]
    # smg 1.13 reports chat logprobs per text piece, not per token, streamed or not: a token that
    # ends inside a UTF-8 character is held back with its text and its entry is dropped or merged
    # (non-streamed, the trailing held-back tokens have no entry). So: every value is the reference
    # value of a token at or after the previous one (nothing invented, order kept), and every token
    # whose text stands alone is reported.
    position = 0
    for value in logprobs:
        matches = [j for j in range(position, len(want_logprobs)) if abs(want_logprobs[j] - value) <= LOGPROB_TOL]
        assert matches, (value, want_logprobs[position:])
        position = matches[0]
    standalone = [j for j, token in enumerate(want) if "\ufffd" not in engine.tokenizer.decode([token])
                  and (j == 0 or "\ufffd" not in engine.tokenizer.decode([want[j - 1]]))]
    for j in standalone:
        assert any(abs(v - want_logprobs[j]) <= LOGPROB_TOL for v in logprobs), (j, want_logprobs, logprobs)


def test_n_greater_than_one_gives_n_complete_choices(cluster, engine, hf_tokenizer) -> None:
    rng = random.Random()
    text = random_words(rng, 6)
    n, max_new = rng.randint(2, 4), rng.randint(3, 8)
    want_text, _ = offline_greedy(engine, completion_ids(engine, text), max_new)
    ids = [rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(4, 40))]
    want_ids, _ = offline_greedy(engine, ids, max_new)
    messages = [{"role": "user", "content": text}]
    chat_prompt = list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
    want_chat, _ = offline_greedy(engine, chat_prompt, max_new)
    common = {"model": cluster.served_model_name, "temperature": 0.0, "ignore_eos": True, "n": n}

    async def main(session):
        url = cluster.router_url
        completions = await post_json(session, f"{url}/v1/completions", {**common, "prompt": text, "max_tokens": max_new})
        chat = await post_stream(session, f"{url}/v1/chat/completions",
                                 {**common, "messages": messages, "max_tokens": max_new, "stream": True})
        generate = await post_json(session, f"{url}/generate", {
            "model": cluster.served_model_name, "input_ids": ids,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True, "n": n}})
        return completions, chat, generate

    completions, chat, generate = run(session_call(main))
    assert completions.status == 200, completions.text
    assert sorted(c["index"] for c in completions.body["choices"]) == list(range(n))
    assert all(same_text(c["text"], want_text, engine) for c in completions.body["choices"])
    assert completions.body["usage"]["completion_tokens"] == n * max_new
    assert chat.status == 200, chat.text
    by_index: dict[int, str] = {}
    for event in chat.events:
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            by_index[choice["index"]] = by_index.get(choice["index"], "") + piece
    assert sorted(by_index) == list(range(n))
    assert all(same_text(text, want_chat, engine) for text in by_index.values()), by_index
    assert generate.status == 200, generate.text
    assert [item["output_ids"] for item in generate.body] == [want_ids] * n


def _chat_body(cluster, messages, max_new: int, k: int, stream: bool) -> dict:
    body = {"model": cluster.served_model_name, "messages": messages, "max_tokens": max_new, "temperature": 0.0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": k, "stream": stream}
    return {**body, "stream_options": {"include_usage": True}} if stream else body


def test_streamed_chat_logprobs_equal_the_unstreamed_entry_for_entry(cluster, engine, hf_tokenizer) -> None:
    """A streamed chunk that decodes to no text loses its logprobs in smg 1.13; the workers cut
    streams at whole text pieces (workers/api/text_pieces.py), so a streamed answer carries
    the same entries as the unstreamed one (before: 6-7 of 8 whenever a token split a character)."""
    rng = random.Random()
    for _ in range(4):
        messages = [{"role": "user", "content": random_words(rng, rng.randint(2, 10))}]
        max_new, k = rng.randint(6, 12), rng.randint(0, 3)
        want, _ = offline_greedy(engine, chat_prompt_ids(hf_tokenizer, messages), max_new)
        body = {"model": cluster.served_model_name, "messages": messages, "max_tokens": max_new,
                "temperature": 0.0, "ignore_eos": True, "logprobs": True, **({"top_logprobs": k} if k else {})}

        async def main(session):
            url = f"{cluster.router_url}/v1/chat/completions"
            return await post_json(session, url, body), await post_stream(session, url, {**body, "stream": True})

        whole, streamed = run(session_call(main))
        assert whole.status == 200 and streamed.status == 200, (whole.text, streamed.text)
        unstreamed = whole.body["choices"][0]["logprobs"]["content"]
        pieces = [e for ev in streamed.events for c in ev.get("choices") or []
                  for e in ((c.get("logprobs") or {}).get("content") or [])]
        assert [e["token"] for e in pieces] == [e["token"] for e in unstreamed], (want, unstreamed, pieces)
        for got, reference in zip(pieces, unstreamed):
            assert got["logprob"] == pytest.approx(reference["logprob"], abs=LOGPROB_TOL)
            assert [t["token"] for t in got.get("top_logprobs") or []] == \
                [t["token"] for t in reference.get("top_logprobs") or []]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_equal_the_offline_top_k(cluster, engine, hf_tokenizer, stream: bool) -> None:
    rng = random.Random()
    messages = [{"role": "user", "content": random_words(rng, rng.randint(2, 10))}]
    prompt = list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))
    max_new, k = rng.randint(3, 8), rng.randint(1, MAX_TOP_LOGPROBS)
    want, _ = offline_greedy(engine, prompt, max_new)
    reference = reference_logprobs(engine, prompt, want, k=min(engine.vocab_size, k + 8))

    async def main(session):
        url = f"{cluster.router_url}/v1/chat/completions"
        body = _chat_body(cluster, messages, max_new, k, stream)
        return await (post_stream(session, url, body) if stream else post_json(session, url, body))

    reply = run(session_call(main))
    assert reply.status == 200, reply.text
    if stream:
        entries = [e for ev in reply.events for c in ev.get("choices") or []
                   for e in ((c.get("logprobs") or {}).get("content") or [])]
    else:
        entries = reply.body["choices"][0]["logprobs"]["content"]
    assert entries and all(len(e["top_logprobs"]) == k for e in entries), entries

    def text(token: int) -> str:
        return engine.tokenizer.decode([token], skip_special_tokens=False)
    # smg reports per text piece (see the chat logprob test); a token whose text stands alone has its
    # own entry: its top list is the reference's k largest, each token's value its reference value.
    # A special token (EOS drawn mid-answer under ignore_eos) has no text in the answer and no entry
    # of its own (smg decodes skipping them; run 2114677491 drew EOS as the 7th of 8 tokens).
    standalone = [j for j, token in enumerate(want) if "\ufffd" not in text(token)
                  and engine.tokenizer.decode([token], skip_special_tokens=True)
                  and (j == 0 or "\ufffd" not in text(want[j - 1]))]
    for j in standalone:
        entry = next((e for e in entries if e["token"] == text(want[j])
                      and abs(e["logprob"] - reference[j].chosen) <= LOGPROB_TOL), None)
        assert entry is not None, (j, text(want[j]), reference[j].chosen, entries)
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx([v for _, v in reference[j].top[:k]], abs=LOGPROB_TOL), (j, entry)
        by_text: dict[str, list[float]] = {}
        for token, value in reference[j].top:
            by_text.setdefault(text(token), []).append(value)
        for top in entry["top_logprobs"]:
            if "\ufffd" in top["token"]:
                continue  # a broken UTF-8 piece: smg and the tokenizer replace its bytes their own ways
            assert any(abs(v - top["logprob"]) <= LOGPROB_TOL for v in by_text.get(top["token"], [])), (j, top)


def test_generate_and_completions_with_top_logprobs_answer_whole(cluster, engine) -> None:
    """smg 1.13 passes top_logprobs_num / `logprobs: k` to the workers but shows no top logprobs in
    these answers; what it shows must still be right (and top logprobs, should it ever show them)."""
    rng = random.Random()
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(5, 60))]
    max_new, k = rng.randint(3, 8), rng.randint(1, MAX_TOP_LOGPROBS)
    want, _ = offline_greedy(engine, prompt, max_new)
    reference = reference_logprobs(engine, prompt, want, k=k)
    text = random_words(rng, rng.randint(3, 8))
    want_text, _ = offline_greedy(engine, completion_ids(engine, text), max_new)
    body = {"model": cluster.served_model_name, "input_ids": prompt, "return_logprob": True, "top_logprobs_num": k,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}

    async def main(session):
        url = cluster.router_url
        whole = await post_json(session, f"{url}/generate", {**body, "stream": False})
        streamed = await post_stream(session, f"{url}/generate", {**body, "stream": True})
        completion = await post_json(session, f"{url}/v1/completions", {
            "model": cluster.served_model_name, "prompt": text, "max_tokens": max_new, "temperature": 0.0,
            "ignore_eos": True, "logprobs": k})
        return whole, streamed, completion

    whole, streamed, completion = run(session_call(main))
    assert whole.status == 200, whole.text
    item = whole.body[0] if isinstance(whole.body, list) else whole.body
    assert item["output_ids"] == want
    meta = item["meta_info"]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx([r.chosen for r in reference], abs=LOGPROB_TOL)
    for entry, ref in zip(meta.get("output_top_logprobs") or [], reference):
        assert [e[0] for e in entry] == pytest.approx([v for _, v in ref.top], abs=LOGPROB_TOL)
    assert streamed.status == 200 and [t for e in streamed.events for t in e.get("output_ids") or []] == want
    assert completion.status == 200, completion.text
    assert same_text(completion.body["choices"][0]["text"], want_text, engine)


def test_unsupported_logprob_requests_are_refused_naming_the_field(cluster) -> None:
    model = cluster.served_model_name
    over = MAX_TOP_LOGPROBS + random.randint(1, 50)
    cases = {
        ("/v1/chat/completions", "top_logprobs"): {  # smg's own check (OpenAI's cap of 20)
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": over},
        ("/generate", "top_logprobs_num"): {"model": model, "input_ids": [5, 6, 7], "return_logprob": True,
                                            "top_logprobs_num": over, "sampling_params": {"max_new_tokens": 3}},
        ("/generate", "logprob_start_len"): {"model": model, "input_ids": [5, 6, 7], "return_logprob": True,
                                             "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 3}},
    }

    async def main(session):
        return {key: await post_json(session, f"{cluster.router_url}{key[0]}", body) for key, body in cases.items()}

    for (path, field), reply in run(session_call(main)).items():
        assert reply.status == 400, (path, reply.status, reply.text)
        assert field in reply.error_message(), (path, reply.text)


def test_seed_is_honoured_by_the_workers_and_refused_at_the_gateway(cluster, engine) -> None:
    rng = random.Random()
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(4, 30))]
    seed = rng.randrange(2**31)
    host = cluster.spec.host
    prefill = cluster.prefill_workers()[0]

    def sampling(seed_value: int):
        params = sampling_proto(max_new_tokens=12, temperature=1.0)
        params.ignore_eos = True
        params.custom_params.update({"seed": seed_value})
        return params

    async def direct(decode, seed_value: int) -> list[int]:
        async with PDClient(prefill.address(host), host, prefill.bootstrap_port, decode.address(host)) as client:
            result = await client.generate(prompt, sampling(seed_value))
        assert result.ok, (result.prefill_error, result.decode_error)
        return result.output_ids

    async def main(session):
        first, second = cluster.decode_workers()
        same = [await direct(first, seed), await direct(second, seed)]
        other = await direct(first, seed + 1)
        body = {"model": cluster.served_model_name, "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "seed": seed}}
        through = [await post_json(session, f"{cluster.router_url}/generate", body) for _ in range(2)]
        return same, other, through

    same, other, through = run(session_call(main))
    # Workers: the seed fixes every draw (keyed on seed and step), whichever decode worker runs it.
    assert same[0] == same[1] and len(same[0]) == 12
    assert other != same[0]
    # smg 1.13 accepts `seed` but never forwards it, so a seeded request through it would silently
    # not be reproducible: the gateway guard refuses it with 400 instead (deepseek_pd/gateway_guard).
    # If smg starts forwarding seeds, drop the guard's rule and assert equal outputs here instead.
    assert [r.status for r in through] == [400, 400], [(r.status, r.text) for r in through]


def bad_requests(model: str, vocab: int, max_context: int) -> list[tuple[str, dict, set[int], str]]:
    """(path, body, accepted statuses, a word the message must contain)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    gen = {"model": model, "input_ids": [5, 6, 7]}
    return [
        ("/generate", {**gen, "input_ids": [5, vocab + 7], "sampling_params": {"max_new_tokens": 3}},
         {400}, "outside the vocabulary"),
        ("/generate", {**gen, "sampling_params": {"max_new_tokens": -1}}, {400, 422}, "max_new_tokens"),
        ("/v1/chat/completions", {**chat, "max_tokens": -1}, {400, 422}, "max_tokens"),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 0}, {400}, "max_new_tokens"),
        ("/generate", {**gen, "input_ids": [5] * (max_context + 10), "sampling_params": {"max_new_tokens": 3}},
         {400}, "context length"),
        ("/generate", {**gen, "sampling_params": {"max_new_tokens": 3, "temperature": -1.0}}, {400}, "temperature"),
        ("/v1/chat/completions", {**chat, "temperature": 5.0}, {400}, "temperature"),
        ("/generate", {**gen, "sampling_params": {"max_new_tokens": 3, "top_p": 0.0}}, {400}, "top_p"),
        ("/generate", {**gen, "sampling_params": {"max_new_tokens": 3, "top_p": 1.5}}, {400}, "top_p"),
        ("/v1/chat/completions", {**chat, "top_p": 1.5}, {400}, "top_p"),
        ("/v1/chat/completions", {**chat, "model": "no-such-model"}, {400, 404}, "no-such-model"),
        ("/generate", {**gen, "model": "no-such-model", "sampling_params": {"max_new_tokens": 3}}, {400, 404},
         "no-such-model"),
    ]


def test_bad_input_gets_a_clear_4xx_and_spares_a_concurrent_stream(cluster, engine) -> None:
    rng = random.Random()
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(10, 60))]
    max_new = 40
    want, _ = offline_greedy(engine, prompt, max_new)
    cases = bad_requests(cluster.served_model_name, engine.vocab_size, engine.max_context)

    async def main(session):
        good = asyncio.create_task(post_stream(session, f"{cluster.router_url}/generate", {
            "model": cluster.served_model_name, "input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}))
        replies = []
        for _ in range(2):  # twice over: a refusal must not change how the next one is treated
            replies += await asyncio.gather(*(post_json(session, f"{cluster.router_url}{path}", body)
                                              for path, body, _, _ in cases))
        # A body over --max-payload-size is refused before it is read through.
        oversized = json.dumps({"model": cluster.served_model_name, "text": "x" * (MAX_PAYLOAD_BYTES + 1024)})
        big = await post_json(session, f"{cluster.router_url}/generate", None, data=oversized,
                              headers={"Content-Type": "application/json"})
        return await good, replies, big

    good, replies, big = run(session_call(main))
    for (path, body, statuses, word), reply in zip(cases * 2, replies):
        assert reply.status in statuses, (path, body.get("sampling_params", body), reply.status, reply.text)
        assert word in reply.error_message(), (path, word, reply.text)
    assert big.status == 413, big.text
    assert good.status == 200 and good.events, good.text
    assert not any(e.get("error") for e in good.events)
    assert [t for e in good.events for t in e.get("output_ids") or []] == want


def test_prompt_over_the_context_sent_to_a_worker_is_refused_and_others_go_on(cluster, engine) -> None:
    """smg checks the context itself; a client of the workers' gRPC port (another router, a peer)
    is refused by the worker on the prompt's length alone, while the gateway's stream goes on."""
    rng = random.Random()
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(10, 60))]
    want, _ = offline_greedy(engine, prompt, 32)
    decode = cluster.decode_workers()[0].address(cluster.spec.host)
    n = rng.randint(2_000_000, 3_000_000)
    huge = pb.GenerateRequest(request_id=f"huge-{rng.randrange(10**9)}",
                              tokenized=pb.TokenizedInput(input_ids=[300 + i % 100 for i in range(n)]),
                              sampling_params=sampling_proto(max_new_tokens=4))

    async def main(session):
        good = asyncio.create_task(post_stream(session, f"{cluster.router_url}/generate", {
            "model": cluster.served_model_name, "input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}}))
        async with SchedulerClient(decode) as client:
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(collect(client.generate(huge)), 60)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"prompt has {n} tokens" in info.value.details()
        return await good

    good = run(session_call(main))
    assert good.status == 200 and [t for e in good.events for t in e.get("output_ids") or []] == want
    assert run(wait_for_pages(decode, 0, timeout_s=20)) == 0
