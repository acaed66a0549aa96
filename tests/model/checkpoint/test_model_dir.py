"""model/checkpoint/model_dir.py: which directory `--model` names, and the tokenizer and JSON files in it."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.model.checkpoint.model_dir import load_tokenizer, read_json, resolve_model_dir, served_name
from deepseek_pd.model.checkpoint.tiny import ensure_tiny_model


def test_tiny_names_and_directories_resolve(tmp_path) -> None:
    assert resolve_model_dir("tiny") == ensure_tiny_model("v3") == resolve_model_dir("tiny-v3")
    assert resolve_model_dir("tiny-v2") == ensure_tiny_model("v2")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert resolve_model_dir(tmp_path / "ckpt") == tmp_path / "ckpt"
    assert served_name("tiny", resolve_model_dir("tiny")) == "tiny"
    assert served_name(str(tmp_path / "ckpt"), tmp_path / "ckpt") == "ckpt"
    with pytest.raises(UserError, match="neither 'tiny' nor an existing directory"):
        resolve_model_dir(tmp_path / "missing")
    with pytest.raises(UserError, match="has no config.json"):
        resolve_model_dir(tmp_path)


def test_load_tokenizer(tmp_path) -> None:
    from tokenizers import Tokenizer

    tiny = resolve_model_dir("tiny")
    tokenizer = load_tokenizer(tiny)
    reference = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    rng = random.Random()
    text = "".join(rng.choice("abc xyz,.!?\n") for _ in range(rng.randint(1, 80)))
    assert tokenizer.encode(text).ids == reference.encode(text).ids
    assert load_tokenizer(tmp_path) is None  # no tokenizer.json: callers refuse text prompts
    shutil.copy(tiny / "config.json", tmp_path / "config.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path)


def test_read_json(tmp_path) -> None:
    payload = {"a": random.randint(0, 10**9)}
    (tmp_path / "config.json").write_text(json.dumps(payload))
    assert read_json(tmp_path) == payload
    assert read_json(tmp_path, "generation_config.json", required=False) == {}
    with pytest.raises(UserError, match="generation_config.json not found"):
        read_json(tmp_path, "generation_config.json")
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(UserError, match="not valid JSON"):
        read_json(tmp_path, "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="expected a JSON object"):
        read_json(tmp_path, "list.json")


def test_every_reader_of_config_json_says_the_same(tmp_path) -> None:
    """The loader, ModelConfig and the served model's info read config.json through `read_json`:
    for each way it can be broken (missing, not JSON, not UTF-8, not an object) each refuses it with
    the same UserError (before, ModelConfig crashed with a UnicodeDecodeError on a binary file)."""
    from deepseek_pd.model.checkpoint.loader import read_hf_config
    from deepseek_pd.model.config import ModelConfig

    rng = random.Random()
    broken = {"missing": None, "not json": "{" + "x" * rng.randint(0, 9), "not utf-8": b"{\xff\xfe}",
              "not an object": json.dumps([rng.randint(0, 9)])}
    for name, content in broken.items():
        directory = tmp_path / name.replace(" ", "-")
        directory.mkdir()
        if isinstance(content, bytes):
            (directory / "config.json").write_bytes(content)
        elif content is not None:
            (directory / "config.json").write_text(content)
        messages = set()
        for read in (read_json, read_hf_config, ModelConfig.from_hf,
                     lambda d: ModelConfig.from_hf(d / "config.json")):
            with pytest.raises(UserError) as exc:
                read(directory)
            messages.add(str(exc.value))
        assert len(messages) == 1, (name, messages)
