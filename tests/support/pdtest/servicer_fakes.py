"""A deterministic `WorkerEngine` stand-in and a tokenizer-only model directory, for servicer tests.

The fake's output is a pure function of the prompt (`expected_tokens`), so a test can compute what
must come back; it also records aborts and keeps a page count so tests can check the servicer
frees work when a caller goes away. Scripted failures come from the prompt's first token:
`[FAIL_TOKEN, i, ...]` makes the engine yield `Failed(FAILURE_CODES[i])` after two tokens, `CRASH_TOKEN` makes it
raise after one, `SLOW_TOKEN` makes each step sleep. `FakeEngine(scripted=False)` has no scripts
(fuzzing draws those ids as ordinary prompts).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from deepseek_pd.workers.engine.interface import (
    Failed, FailureCode, Finished, GenerateRequest, Loads, TokenChunk)

VOCAB = 300
EOS = 1
FAIL_TOKEN = 7
SLOW_TOKEN = 8  # each step sleeps, so a test can cancel mid-stream
CRASH_TOKEN = 6  # the engine raises after one token: an engine bug the servicer must contain
PAGE_SIZE = 4


FAILURE_CODES = list(FailureCode)  # FAIL_TOKEN, i: fails with FAILURE_CODES[i % len]


def expected_tokens(input_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """The fake's greedy output: never EOS, depends on every input token."""
    base = sum(input_ids) * 31 + len(input_ids)
    return [2 + (base + 17 * i) % (VOCAB - 2) for i in range(max_new_tokens)]


class FakeEngine:
    def __init__(self, total_pages: int = 1000, scripted: bool = True) -> None:
        self.total_pages = total_pages
        self.scripted = scripted
        self.pages_in_use: dict[str, int] = {}
        self.aborted: list[str] = []
        self.requests: list[GenerateRequest] = []
        self._cancel: dict[str, asyncio.Event] = {}

    async def generate(self, request: GenerateRequest):
        self.requests.append(request)
        tokens = expected_tokens(request.input_ids, request.sampling.max_new_tokens)
        n_pages = -(-(len(request.input_ids) + len(tokens)) // PAGE_SIZE)
        self.pages_in_use[request.rid] = n_pages
        cancel = self._cancel.setdefault(request.rid, asyncio.Event())
        script = request.input_ids[0] if self.scripted else None
        try:
            for i, token in enumerate(tokens):
                if script == SLOW_TOKEN:
                    await asyncio.sleep(0.05)
                else:
                    await asyncio.sleep(0)
                if cancel.is_set():
                    yield Finished("abort", len(request.input_ids), i)
                    return
                if script == CRASH_TOKEN and i == 1:
                    raise RuntimeError("scripted engine bug")
                if script == FAIL_TOKEN and i == 2:
                    code = FAILURE_CODES[request.input_ids[1] % len(FAILURE_CODES)]
                    yield Failed(code, f"scripted failure {code.name}")
                    return
                yield TokenChunk((token,))
            yield Finished("length", len(request.input_ids), len(tokens))
        finally:
            self.pages_in_use.pop(request.rid, None)
            self._cancel.pop(request.rid, None)

    async def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        event = self._cancel.get(rid)
        if event is None:
            return False
        event.set()
        self.pages_in_use.pop(rid, None)
        return True

    def loads(self) -> Loads:
        used = sum(self.pages_in_use.values())
        return Loads(num_running=len(self.pages_in_use), num_waiting=0,
                     kv_used_pages=used, kv_total_pages=self.total_pages)

    def is_healthy(self) -> bool:
        return True


def make_tokenizer_model_dir(path: Path, max_context: int = 64) -> Path:
    """config.json + a tiny byte-level BPE tokenizer with a chat template (no weights)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog"] * 20 + ["hello world, how are you?"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    # A whole model config (the tiny model's shape), so that `serve` can resolve its runner config
    # for this directory even though the scripted engine never loads weights.
    from deepseek_pd.model.checkpoint.tiny import tiny_config

    (path / "config.json").write_text(json.dumps({
        **tiny_config("v3", max(vocab, VOCAB)), "max_position_embeddings": max_context,
        "bos_token_id": 0, "eos_token_id": EOS}))
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_context}))
    return path


def build_fake_engine(config, metrics=None) -> FakeEngine:
    """`deepseek-pd serve --engine-factory tests/support/pdtest/servicer_fakes.py:build_fake_engine` (the test
    hook; `config` is the resolved ServeConfig and `metrics` the WorkerMetrics, which a scripted engine
    does not need)."""
    return FakeEngine()
