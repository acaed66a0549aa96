"""`deepseek-pd generate` and `make-tiny-model`: greedy tokens equal HF `generate` for every
attention method, and every kind of bad input is one line on stderr with exit code 2."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepseek_pd.cli import main

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]
transformers = pytest.importorskip("transformers")
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    for arch in ("v3", "v2"):  # through the CLI itself
        assert main(["make-tiny-model", str(root / arch), "--arch", arch]) == 0
    return {arch: root / arch for arch in ("v3", "v2")}


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    models = {}
    for arch, path in checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        models[arch] = model
    return models


def _generate_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("arch", ["v3", "v2"])
@pytest.mark.parametrize("method,chunk", [("auto", "2048"), ("auto", "6"), ("mha", "2048"), ("mha", "5"),
                                          ("mha_chunked_kv", "8"), ("mla", "2048")])
def test_cli_greedy_equals_hf(checkpoints, hf_models, capsys, arch, method, chunk):
    rng = random.Random()
    prompt = [0] + [rng.randrange(4, 400) for _ in range(rng.randint(10, 30))]
    out = _generate_json(capsys, "--model", str(checkpoints[arch]), "--input-ids", ",".join(map(str, prompt)),
                         "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--attention-method", method,
                         "--chunked-prefill-size", chunk)
    with torch.no_grad():
        ref = hf_models[arch].generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert out["output_ids"] == ref[0, len(prompt):].tolist()
    assert out["finish_reason"] == "length" and out["prompt_tokens"] == len(prompt)


def test_cli_text_prompt_and_plain_output(checkpoints, hf_models, capsys):
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["v3"])
    text = "The robot looked at the sky"
    out = _generate_json(capsys, "--model", str(checkpoints["v3"]), "--prompt", text, "--ignore-eos",
                         "--max-new-tokens", "8")
    ids = tokenizer(text).input_ids
    assert out["prompt_tokens"] == len(ids) and ids.count(tokenizer.bos_token_id) == 1
    with torch.no_grad():
        ref = hf_models["v3"].generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert out["output_ids"] == ref[0, len(ids):].tolist()
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    capsys.readouterr()
    assert main(["generate", "--model", str(checkpoints["v3"]), "--prompt", text, "--ignore-eos",
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == out["text"] + "\n"


def test_cli_seeded_sampling_is_reproducible(checkpoints, capsys):
    argv = ["--model", str(checkpoints["v2"]), "--input-ids", "0,50,60,70", "--temperature", "1.0",
            "--top-k", "50", "--seed", str(random.randrange(1000)), "--ignore-eos", "--max-new-tokens", "10"]
    assert _generate_json(capsys, *argv) == _generate_json(capsys, *argv)


# ---- bad input: a fresh process each, as a user would see it -----------------------------------

def _run_cli(*argv: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEEPSEEK_PD_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "deepseek_pd.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=120)


def _assert_one_line_error(proc: subprocess.CompletedProcess, match: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and match in lines[0], proc.stderr


def test_cli_bad_input(checkpoints, tmp_path, capsys):
    good = str(checkpoints["v3"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{\"num_hidden_layers\": ")
    bad_field = tmp_path / "bad_field"
    bad_field.mkdir()
    (bad_field / "config.json").write_text(json.dumps(
        {**json.loads((checkpoints["v3"] / "config.json").read_text()), "kv_lora_rank": -3}))
    missing = tmp_path / "missing"
    missing.mkdir()
    config = json.loads((checkpoints["v3"] / "config.json").read_text())
    (missing / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(checkpoints["v3"] / "model.safetensors"))
    dropped = "model.layers.1.self_attn.kv_b_proj.weight"
    del tensors[dropped]
    tensors["model.layers.2.mlp.surprise.weight"] = torch.zeros(2)
    save_file(tensors, str(missing / "model.safetensors"))
    cases = [
        (("--model", good, "--input-ids", "1,,2"), "must be comma-separated integers"),
        (("--model", good, "--input-ids", f"0,{config['vocab_size']}"), "outside the vocabulary"),
        (("--model", good, "--prompt", ""), "prompt is empty"),
        (("--model", good, "--input-ids", ",".join(["7"] * config["max_position_embeddings"])),
         f"maximum context is {config['max_position_embeddings']}"),
        (("--model", good, "--prompt", "hi", "--temperature", "-1"), "temperature=-1.0"),
        (("--model", good, "--prompt", "hi", "--top-p", "1.5"), "top_p=1.5"),
        (("--model", good, "--prompt", "hi", "--max-new-tokens", "0"), "max_new_tokens=0"),
        (("--model", good, "--prompt", "hi", "--chunked-prefill-size", "0"), "chunked_prefill_size"),
        (("--model", str(tmp_path / "nope"), "--prompt", "hi"), "neither 'tiny' nor an existing directory"),
        (("--model", good, "--prompt", "hi", "--device", "toaster"), "not a torch device"),
        (("--model", str(broken), "--prompt", "hi"), "config.json"),
        (("--model", str(bad_field), "--prompt", "hi"), "kv_lora_rank"),
        (("--model", str(missing), "--input-ids", "0,5"), dropped),
    ]
    # In-process: any exception other than UserError would escape main() and fail the test.
    for argv, match in cases:
        capsys.readouterr()
        assert main(["generate", *argv]) == 2, argv
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1 and match in lines[0], (argv, captured.err)
        assert captured.out == ""
    assert "model.layers.2.mlp.surprise.weight" in lines[0]
    # And twice as a user sees it: a fresh process, exit code 2, no traceback.
    _assert_one_line_error(_run_cli("generate", *cases[1][0], cache=tmp_path / "cache"), cases[1][1])
    (tmp_path / "file.txt").write_text("")
    _assert_one_line_error(_run_cli("make-tiny-model", str(tmp_path / "file.txt" / "x"), cache=tmp_path),
                           "cannot create")


def test_cli_tiny_default_model(tmp_path):
    proc = _run_cli("generate", "--input-ids", "0,10,20", "--max-new-tokens", "4", "--ignore-eos", "--json",
                    cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["output_ids"]) == 4
    assert (tmp_path / "cache" / "tiny-v3" / "config.json").is_file()
