"""When a request stops, and the text it produced so far.

`StopChecker.append(token)` is called once per sampled token and answers None (keep going) or a
`Finish`. Checks, in this order (the first that fires wins):
1. the token is in `stop_token_ids`, or is an eos id and `ignore_eos` is off -> "stop", matched_stop=id;
2. the incrementally detokenised text now contains a stop string -> "stop", matched_stop=the string;
   the text is cut just before it (the token ids keep the token that completed it, as SGLang does);
3. the output has `max_new_tokens` tokens -> "length".
A stop token beats "length" on the same step: an eos as the last allowed token reports "stop".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, Union

from deepseek_pd.errors import UserError
from deepseek_pd.model.sampling.params import SamplingParams


class Decoder(Protocol):
    """The one method we need from `tokenizers.Tokenizer`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length"
    matched_stop: Union[int, str, None] = None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without re-decoding everything each step.

    A byte-level token can end in the middle of a UTF-8 character; such a tail decodes to U+FFFD
    and is held back until the next token completes it (vLLM's prefix/read offset scheme).
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def append(self, token_id: int) -> str:
        """Adds one token; returns the text it completed (possibly empty)."""
        self._ids.append(token_id)
        before = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip)
        after = self._tokenizer.decode(self._ids[self._prefix_offset:], skip_special_tokens=self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text including any held-back incomplete tail (as replacement characters)."""
        tail = self._tokenizer.decode(self._ids[self._read_offset:], skip_special_tokens=self._skip)
        return self.text + tail


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int],
                 tokenizer: Decoder | None = None, max_new_tokens: int | None = None) -> None:
        """`max_new_tokens` overrides params' (the engine caps it by the context length)."""
        if params.stop and tokenizer is None:
            raise UserError("stop strings need a tokenizer; this model has no tokenizer.json")
        self._params = params
        self._stop_ids = frozenset(params.stop_token_ids)
        self._eos_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._max_new_tokens = params.max_new_tokens if max_new_tokens is None else max_new_tokens
        self._detokenizer = (IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
                             if tokenizer is not None else None)
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self._num_tokens = 0
        self._stop_text: str | None = None
        self.finish: Finish | None = None

    @property
    def text(self) -> str:
        """The output text so far; after a stop-string match, everything before the match."""
        if self._stop_text is not None:
            return self._stop_text
        return self._detokenizer.flush() if self._detokenizer is not None else ""

    def append(self, token_id: int) -> Finish | None:
        if self.finish is not None:
            raise RuntimeError("StopChecker.append after the request finished")
        self._num_tokens += 1
        if token_id in self._stop_ids or token_id in self._eos_ids:
            self.finish = Finish("stop", matched_stop=token_id)
        elif self._detokenizer is not None:
            old_len = len(self._detokenizer.text)
            if self._detokenizer.append(token_id) and self._params.stop:
                self.finish = self._match_stop_string(old_len)
        if self.finish is None and self._num_tokens >= self._max_new_tokens:
            self.finish = Finish("length")
        if self.finish is not None and self._detokenizer is not None and self._stop_text is None:
            self._stop_text = self._detokenizer.flush()
        return self.finish

    def _match_stop_string(self, old_len: int) -> Finish | None:
        text = self._detokenizer.text
        start = max(0, old_len - self._longest_stop + 1)  # a match may straddle the old text
        best: tuple[int, str] | None = None
        for stop in self._params.stop:
            index = text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        self._stop_text = text[:best[0]]
        return Finish("stop", matched_stop=best[1])
