"""`TextPieces` against a model of the gateway's stream decoding (smg 1.13).

The oracle replays what smg does with each streamed chunk: it steps its own incremental decoder
(the `tokenizers` DecodeStream, as smg's) over the chunk's tokens and drops the chunk, logprobs
and all, when that yields no text. Over random token streams of the tiny model's byte-level
tokenizer (many tokens end inside a UTF-8 character), cut into random engine chunks (printed seed):
- the chunks TextPieces releases hold every token, logprob and top-logprob entry once, in order;
- every released chunk but the finishing one decodes to text at the gateway, so no entry is lost;
- without it (the engine's chunks as they come) entries are lost on the same streams.
"""
from __future__ import annotations

import random

import pytest
from tokenizers.decoders import DecodeStream

from deepseek_pd.model.checkpoint.model_dir import load_tokenizer
from deepseek_pd.model.checkpoint.tiny import ensure_tiny_model
from deepseek_pd.model.sampling.sampled_host import TopLogprobs
from deepseek_pd.workers.engine.interface import TokenChunk
from deepseek_pd.workers.api.text_pieces import TextPieces


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_tiny_model())


def gateway_entries(tokenizer, chunks: list[TokenChunk], skip_special_tokens: bool) -> list[float]:
    """The logprobs a client gets: those of every chunk that decodes to some text."""
    stream, shown = DecodeStream(skip_special_tokens=skip_special_tokens), []
    for chunk in chunks:
        texts = [stream.step(tokenizer, token) for token in chunk.token_ids]
        if any(text for text in texts if text is not None):
            shown.extend(chunk.logprobs)
    return shown


def random_chunks(rng: random.Random, vocab: int, length: int) -> list[TokenChunk]:
    tokens = [rng.randrange(vocab) for _ in range(length)]
    chunks, i = [], 0
    while i < length:
        size = rng.choice([1, 1, 1, 2, 3])
        ids = tuple(tokens[i:i + size])
        logprobs = tuple(-rng.random() * 5 for _ in ids)
        top = tuple(TopLogprobs((t,), (v,)) for v, t in zip(logprobs, ids))
        chunks.append(TokenChunk(ids, logprobs, top))
        i += size
    return chunks


def test_released_chunks_keep_every_entry_the_gateway_would_show(tokenizer) -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab_size()
    lost_without = 0
    for _ in range(200):
        skip = rng.random() < 0.7
        chunks = random_chunks(rng, vocab, rng.randint(1, 24))
        pieces = TextPieces(tokenizer, skip)
        released = [out for out in (pieces.push(c) for c in chunks) if out is not None]
        tail = pieces.finish()
        assert [t for c in released + ([tail] if tail else []) for t in c.token_ids] == \
            [t for c in chunks for t in c.token_ids]
        assert [v for c in released + ([tail] if tail else []) for v in c.logprobs] == \
            [v for c in chunks for v in c.logprobs]
        assert all(len(c.top_logprobs) == len(c.token_ids) for c in released)
        assert gateway_entries(tokenizer, released, skip) == [v for c in released for v in c.logprobs]
        lost_without += len(gateway_entries(tokenizer, chunks, skip)) < sum(len(c.logprobs) for c in chunks)
    assert lost_without > 0  # the streams did split characters


def test_a_token_that_completes_text_is_never_held(tokenizer) -> None:
    ids = tokenizer.encode("plain ascii words only", add_special_tokens=False).ids
    pieces = TextPieces(tokenizer, True)
    for token in ids:
        assert pieces.push(TokenChunk((token,), (-1.0,))) == TokenChunk((token,), (-1.0,))
    assert pieces.finish() is None
