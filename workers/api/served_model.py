"""What a worker tells the router about its model (GetModelInfo), read once from the checkpoint.

The router reads these at start-up: it loads the tokenizer from `tokenizer_path` (or its own
`--model-path`), stops on `eos_token_ids`, routes `/generate` by `served_model_name`, and refuses
prompts longer than `max_context_length`. Reading plain JSON keeps this module free of the model
code (`model_dir.read_json` does not import torch), so a worker can answer GetModelInfo before
(or without) building its engine.

Example: the embedded tiny model gives
`ServedModelInfo(model_path="~/.cache/deepseek-pd/tiny-v3", served_model_name="tiny",
max_context_length=4096, eos_token_ids=(1,), architectures=("DeepseekV3ForCausalLM",), ...)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepseek_pd.errors import UserError
from deepseek_pd.model.checkpoint.model_dir import read_json


@dataclass(frozen=True)
class ServedModelInfo:
    model_path: str
    tokenizer_path: str
    served_model_name: str
    max_context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    pad_token_id: int
    architectures: tuple[str, ...]
    model_type: str

    @property
    def max_request_input_len(self) -> int:
        """The longest prompt that still leaves room for one generated token."""
        return self.max_context_length - 1

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, served_model_name: str | None = None) -> "ServedModelInfo":
        """Reads config.json (+ generation_config.json when present) of an HF-format checkpoint."""
        path = Path(model_dir).expanduser().resolve()
        config = read_json(path, "config.json")
        generation = read_json(path, "generation_config.json", required=False)
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        bos = generation.get("bos_token_id", config.get("bos_token_id"))
        pad = config.get("pad_token_id")
        max_context = config.get("max_position_embeddings")
        vocab = config.get("vocab_size")
        if not isinstance(max_context, int) or max_context < 2:
            raise UserError(f"{path / 'config.json'}: max_position_embeddings must be an integer >= 2")
        if not isinstance(vocab, int) or vocab < 1:
            raise UserError(f"{path / 'config.json'}: vocab_size must be a positive integer")
        return cls(
            model_path=str(path),
            tokenizer_path=str(path),
            served_model_name=served_model_name or path.name,
            max_context_length=max_context,
            vocab_size=vocab,
            eos_token_ids=eos_ids,
            bos_token_id=-1 if bos is None else int(bos),
            pad_token_id=-1 if pad is None else int(pad),
            architectures=tuple(config.get("architectures") or ()),
            model_type=str(config.get("model_type", "")),
        )
