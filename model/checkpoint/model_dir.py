"""The model directory: which checkpoint `--model` names, and the tokenizer inside it.

The one place these rules live; `serve`, `up`, `generate`, the runner and the workers all call it.

    resolve_model_dir("tiny")            # -> ~/.cache/deepseek-pd/tiny-v3 (generated on first use)
    resolve_model_dir("/models/DeepSeek-V3")   # -> Path, checked to hold a config.json
    load_tokenizer(model_dir)            # -> tokenizers.Tokenizer, or None without tokenizer.json
    read_json(model_dir, "generation_config.json", required=False)  # -> dict ({} when absent)
    served_name("tiny", model_dir)       # -> "tiny"; a directory is served under its own name

Importing this module is cheap (no torch); the tiny model generator is imported only when a
tiny name is resolved.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepseek_pd.errors import UserError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def resolve_model_dir(model: str | Path) -> Path:
    """"tiny" / "tiny-v3" / "tiny-v2" -> the cached generated checkpoint; otherwise a directory
    holding an HF checkpoint's config.json (a UserError names what is missing)."""
    from deepseek_pd.model.checkpoint.tiny import TINY_NAMES, ensure_tiny_model  # torch: only when needed

    name = str(model)
    if name in TINY_NAMES:
        return ensure_tiny_model(TINY_NAMES[name])
    directory = Path(name).expanduser()
    if not directory.is_dir():
        raise UserError(f"model {name!r} is neither 'tiny' nor an existing directory")
    if not (directory / "config.json").is_file():
        raise UserError(f"model directory {str(directory)!r} has no config.json")
    return directory


def served_name(model: str | Path, model_dir: Path) -> str:
    """What clients put in "model": the tiny name itself, else the checkpoint directory's name."""
    return str(model) if str(model).startswith("tiny") else model_dir.name


def load_tokenizer(model_dir: str | Path) -> "Tokenizer | None":
    """The checkpoint's tokenizer.json, or None when it has none (then text prompts and stop
    strings are refused by the caller). A tokenizer.json that does not load is a UserError."""
    from tokenizers import Tokenizer

    file = Path(model_dir) / TOKENIZER_FILE
    if not file.is_file():
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the tokenizers library raises a bare Exception on bad JSON
        raise UserError(f"{file}: cannot load tokenizer ({exc})") from None


def read_json(model_dir: str | Path, name: str = "config.json", required: bool = True) -> dict[str, Any]:
    """A JSON object from the checkpoint directory; {} for a missing optional file, else a UserError
    that names the file and what is wrong with it."""
    path = Path(model_dir) / name
    if not path.is_file():
        if required:
            raise UserError(f"{path} not found: --model must be an HF-format checkpoint directory")
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
