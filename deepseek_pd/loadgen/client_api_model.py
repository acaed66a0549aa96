"""What `bench serving --url` learns about the served model from the client API alone.

Whoever benchmarks a gateway they do not administer has no control-plane key, so `/workers`
(vocabulary, context, the workers' KV size: target_model.py) is closed to them. The client API
still tells enough to load it:

- the model's name, from `GET /v1/models`;
- its tokenizer: a local one (`--tokenizer`: a directory with tokenizer.json, the file itself,
  or a hub id), whose ids below its size are all valid; else the gateway's own, through
  `POST /v1/tokenize` (smg): random text is tokenised there and the prompts are drawn from the
  ids it produced, each one an id the gateway itself sends the workers.

The context is unknown: prompt lengths are not checked against it (a request past it fails with
the gateway's own error). What only the workers know (KV bytes per token, their checkpoint and
how many there are) is left out, and `TargetModel.left_out` says so in the report.

Example, against someone else's smg serving "v2lite", no key:
`TargetModel(name="v2lite", vocab_size=None, max_context_length=None, kv_bytes_per_token=None,
token_ids=(3, 17, ...), left_out="KV bytes per token, ...: /workers answered 401 ...", ...)`.
"""
from __future__ import annotations

import random
import string
from pathlib import Path

from deepseek_pd.client.router_http import RouterClient, RouterError
from deepseek_pd.errors import UserError

# Random text tokenised by the gateway: this many words per call, in this many calls. Enough for
# thousands of distinct ids with a real tokenizer; the prompts only need ids the model accepts.
WORDS_PER_TEXT = 400
TEXTS = 8


def random_text(rng: random.Random, words: int) -> str:
    """Words of random letters, digits and punctuation: text whose tokens spread over the vocabulary."""
    alphabet = string.ascii_letters + string.digits + ".,;:!?-'"
    return " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(words))


async def gateway_token_ids(client: RouterClient, model: str, seed: int) -> tuple[int, ...]:
    """The distinct ids the gateway's tokenizer gives random text (`POST /v1/tokenize`), sorted."""
    rng = random.Random(seed)
    texts = [random_text(rng, WORDS_PER_TEXT) for _ in range(TEXTS)]
    try:
        payload = await client.post_json("/v1/tokenize", {"model": model, "prompt": texts})
    except RouterError as exc:
        raise UserError(f"{client.base_url}/v1/tokenize answered {exc.status} ({exc.message[:200]}): the gateway "
                        f"does not tokenise for clients; pass --tokenizer (the served model's tokenizer), "
                        f"--admin-key-file, or --model DIR") from None
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(row, list) for row in tokens):
        raise UserError(f"{client.base_url}/v1/tokenize gave no token lists (got {str(payload)[:200]})")
    ids = sorted({int(token) for row in tokens for token in row if isinstance(token, int) and token >= 0})
    if not ids:
        raise UserError(f"{client.base_url}/v1/tokenize gave no token ids for {len(texts)} texts")
    return tuple(ids)


def local_tokenizer_size(tokenizer: str) -> int:
    """Ids of `--tokenizer` (a directory with tokenizer.json, the file, or a hub id), added ones counted."""
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    file = path / "tokenizer.json" if path.is_dir() else path
    if (path.is_absolute() or tokenizer.startswith(".") or path.is_dir()) and not file.exists():
        raise UserError(f"--tokenizer {tokenizer}: no such file ({file})")
    try:
        loaded = Tokenizer.from_file(str(file)) if file.exists() else Tokenizer.from_pretrained(tokenizer)
    except Exception as exc:  # an unreadable file, an unknown hub id, no network
        raise UserError(f"--tokenizer {tokenizer}: cannot load a tokenizer ({exc})") from None
    return loaded.get_vocab_size(with_added_tokens=True)
