"""A small byte-level BPE tokenizer for the tiny model, trained deterministically at build time.

Byte-level means every string round-trips (no unknown tokens), so serving tests can send any
text. The special tokens use DeepSeek's names so the router, the chat template and the workers
see the same ids a real DeepSeek-V3 deployment uses for bos (0) and eos (1).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)  # ids 0, 1, 2, 3

# DeepSeek-V3's chat layout, reduced to what minijinja (the router) and jinja2 (HF) both render.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER_TOKEN + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + ASSISTANT_TOKEN + "' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT_TOKEN + "' }}{% endif %}"
)

# Training text. Plain English about the system itself; its only job is to give BPE merges
# that make ordinary prompts a handful of tokens instead of one token per byte.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A request arrives at the router, which picks a
prefill worker and a decode worker and sends the prompt to both at the same time. The prefill
worker computes the key and value cache for every token of the prompt and writes it into the
pages that the decode worker has reserved. Then the decode worker produces one token after
another until it reaches the end of the sentence or the maximum number of new tokens.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is
the capital of France, and Berlin is the capital of Germany. The weather is nice and the sun is
shining. Once upon a time there was a small model that lived on a computer with two cores.
It could not speak very well, but it always answered in the same way when it was asked the same
question, because its weights were fixed by a seed. The model has attention layers and mixture
of experts layers. Each token is routed to a few experts, and a shared expert sees every token.
Latent attention compresses the keys and values into a small vector, so the cache is much smaller
than in ordinary multi head attention. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14.
def main(): return 0  # code is text too; print("hello") and x = [1, 2, 3] are common.
Please write a short story about a robot who learns to paint. The robot looked at the sky and
chose the colour blue. It painted the sea, the mountains and the trees, and then it painted
itself. People came from far away to see the pictures, and they said that the robot was an artist.
Kubernetes runs the workers in pods. An operator watches the custom resource and creates the
stateful sets, the services and the router. When a pod fails, the whole group is recreated.
"""

VOCAB_SIZE = 512


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Trains the BPE model; the same inputs give a byte-identical tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # BOS is added by the tokenizer itself (as DeepSeek's does), so HF, the router and the engine
    # agree on the ids of a plain prompt; the chat template adds it explicitly and is encoded
    # without special tokens.
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                                      special_tokens=[(BOS_TOKEN, bos_id)]),
    ])
    return tokenizer


def write_tokenizer_files(directory: Path, max_length: int) -> int:
    """Writes tokenizer.json and tokenizer_config.json; returns the vocabulary size."""
    tokenizer = build_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"), pretty=False)
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return tokenizer.get_vocab_size()
