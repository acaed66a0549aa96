"""`bench serving --url` against a gateway one does not administer: no control-plane key.

The real gateway (`up`'s smg, whose /workers needs the key `up` wrote) in front of real workers
serving a random checkpoint that is not tiny. Without --admin-key-file the run must still load it,
drawing prompt ids from what the gateway's own tokenizer gives (`/v1/tokenize`; oracle: the
checkpoint's tokenizer.json, encoding the same text), or from --tokenizer; the report must say that
the workers' figures were left out, and carry none of them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdtest.bench_scripts import bench_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from deepseek_pd.launcher.cluster import LocalCluster
    from pdtest.e2e_cluster import cluster_spec

    random_checkpoint = bench_module("random_checkpoint")
    tmp = tmp_path_factory.mktemp("client-api")
    rng = random.Random()
    config = {**random_checkpoint.V2_MINI, "num_hidden_layers": rng.choice([2, 3])}  # the tokenizer's vocabulary
    model_dir = random_checkpoint.write_random_checkpoint(tmp / f"served-{rng.randrange(10**6)}", config,
                                                          seed=rng.randrange(1 << 30))
    with LocalCluster(dataclasses.replace(cluster_spec(tmp), model=str(model_dir))) as cluster:
        yield cluster, model_dir, tmp


def _bench(url: str, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    rng = random.Random()
    argv = [sys.executable, "-m", "deepseek_pd.cli", "bench", "serving", "--url", url, "--num-prompts", "6",
            "--dataset", "fixed", "--input-len", str(rng.randint(20, 60)), "--output-len", "3",
            "--max-concurrency", "3", "--no-progress", "--output-json", str(out),
            "--output-png", str(out.with_suffix(".png")), "--seed", str(rng.randrange(1000)), *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    return proc, json.loads(out.read_text()) if out.exists() else {}


def _assert_left_out(proc: subprocess.CompletedProcess, result: dict) -> None:
    summary, target = result["summary"], result["config"]["target_model"]
    # Every prompt id was one the workers accept, or they would have refused the request.
    assert summary["completed"] == 6 and summary["failed"] == 0, summary["errors"]
    assert summary["kv_bytes_per_token"] is None and target["model_path"] is None
    assert "--admin-key-file" in summary["left_out"] and "/workers answered 401" in summary["left_out"]
    assert "left out" in proc.stdout and "KV bytes per token: left out" in proc.stdout


def test_without_a_key_the_gateways_tokenizer_gives_the_prompt_ids(served) -> None:
    cluster, model_dir, tmp = served
    proc, result = _bench(cluster.router_url, tmp / "gateway.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_left_out(proc, result)
    target = result["config"]["target_model"]
    assert target["name"] == model_dir.name and target["vocab_size"] is None
    assert target["token_pool_size"] > 0 and "/v1/tokenize" in target["source"]


def test_without_a_key_a_local_tokenizer_gives_the_vocabulary(served) -> None:
    from tokenizers import Tokenizer

    cluster, model_dir, tmp = served
    proc, result = _bench(cluster.router_url, tmp / "local.json", "--tokenizer", str(model_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_left_out(proc, result)
    want = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert result["config"]["target_model"]["vocab_size"] == want


def test_the_gateways_ids_are_its_tokenizers_encoding_of_the_text(served) -> None:
    from tokenizers import Tokenizer

    from deepseek_pd.client.router_http import RouterClient
    from deepseek_pd.loadgen import client_api_model

    cluster, model_dir, _ = served
    seed = random.randrange(1 << 30)

    async def ask():
        async with RouterClient(cluster.router_url) as client:
            return await client_api_model.gateway_token_ids(client, model_dir.name, seed)

    got = asyncio.run(ask())
    rng = random.Random(seed)
    texts = [client_api_model.random_text(rng, client_api_model.WORDS_PER_TEXT) for _ in range(client_api_model.TEXTS)]
    local = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    want = sorted({token for text in texts for token in local.encode(text, add_special_tokens=False).ids})
    assert list(got) == want


def test_a_missing_local_tokenizer_is_a_clear_error(served, tmp_path) -> None:
    cluster, _, _ = served
    proc, _ = _bench(cluster.router_url, tmp_path / "x.json", "--tokenizer", str(tmp_path / "nothing-here"))
    assert proc.returncode != 0 and "--tokenizer" in proc.stderr and "Traceback" not in proc.stderr
