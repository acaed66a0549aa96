"""Streamed tokens cut where the gateway's detokenizer cuts text, so no token's logprob is lost.

smg turns each streamed chunk into text with an incremental decoder (the `tokenizers` crate's
DecodeStream: a token whose text ends inside a UTF-8 character, or decodes to nothing, yields no
text yet), and it drops a chunk that yields no text *with its logprobs* (smg 1.13,
routers/grpc/regular/streaming.rs: `if chunk_text.is_empty() { continue; }`). Sent one token per
chunk, such a token's logprob never reached the client: 8 tokens, 6-7 streamed entries.

`TextPieces` runs the same decoder (Python `tokenizers`' DecodeStream, the same crate and rule)
over a request's output and holds tokens back until the last of them yields text, then releases
them as one chunk: the gateway decodes that chunk to non-empty text and reports every token's
logprob in it. Example, tokens a b c where b ends inside a character:

    push(a) -> [a]         push(b) -> []         push(c) -> [b, c]         finish() -> []

What it cannot save: tokens left over at the end of the output that never yield text (a final
split character, a skipped special token) are sent in the last chunk, which the gateway still
decodes to nothing; and text the gateway holds back for a partial `stop` string match.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from deepseek_pd.workers.engine.interface import TokenChunk


@dataclass
class TextPieces:
    tokenizer: Tokenizer
    skip_special_tokens: bool
    _stream: DecodeStream = field(init=False)
    _held: list[TokenChunk] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def push(self, chunk: TokenChunk) -> TokenChunk | None:
        """The tokens to send now (everything up to the last one that completes text), or None."""
        cut = 0
        for i, token in enumerate(chunk.token_ids):
            if self._stream.step(self.tokenizer, token) is not None:
                cut = i + 1
        if cut == 0:
            self._held.append(chunk)
            return None
        ready = _join([*self._held, _slice(chunk, 0, cut)])
        self._held = [_slice(chunk, cut, len(chunk.token_ids))] if cut < len(chunk.token_ids) else []
        return ready

    def finish(self) -> TokenChunk | None:
        """What is still held, to send before the request's last message (None when nothing)."""
        held, self._held = self._held, []
        return _join(held) if held else None


def _slice(chunk: TokenChunk, start: int, stop: int) -> TokenChunk:
    return TokenChunk(chunk.token_ids[start:stop], chunk.logprobs[start:stop], chunk.top_logprobs[start:stop])


def _join(chunks: list[TokenChunk]) -> TokenChunk:
    return TokenChunk(tuple(t for c in chunks for t in c.token_ids), tuple(v for c in chunks for v in c.logprobs),
                      tuple(e for c in chunks for e in c.top_logprobs))
