"""`bench serving --url` against `up` whose workers run a float32 checkpoint in bfloat16
(`--dtype bfloat16`): the report's KV bytes per token are the workers' (GetServerInfo), half of
what config.json would say, and the run succeeds on the served (non-tiny) vocabulary."""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdtest.bench_scripts import bench_module

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_bench_url_reports_the_workers_runtime_kv_bytes(tmp_path: Path) -> None:
    from deepseek_pd.launcher.cluster import LocalCluster
    from pdtest.e2e_cluster import cluster_spec

    module = bench_module("random_checkpoint")
    rng = random.Random()
    config = {**module.V2_MINI, "vocab_size": rng.randint(120, 400), "num_hidden_layers": rng.choice([2, 3]),
              "kv_lora_rank": rng.choice([16, 24, 48]), "qk_rope_head_dim": rng.choice([8, 16]),
              "torch_dtype": "float32"}
    model_dir = module.write_random_checkpoint(tmp_path / "model", config, seed=rng.randrange(1 << 30))
    runtime_kv = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    out_json = tmp_path / "bench.json"
    spec = dataclasses.replace(cluster_spec(tmp_path, extra_worker_args=("--dtype=bfloat16",)), model=str(model_dir))
    with LocalCluster(spec) as cluster:
        argv = [sys.executable, "-m", "deepseek_pd.cli", "bench", "serving", "--url", cluster.router_url,
                "--num-prompts", "3", "--dataset", "fixed", "--input-len", "24", "--output-len", "3",
                "--max-concurrency", "3", "--no-progress", "--output-json", str(out_json),
                "--output-png", str(tmp_path / "bench.png"), "--seed", str(rng.randrange(1000)),
                "--admin-key-file", str(cluster.log_dir / "control-plane-key")]  # /workers is locked
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out_json.read_text())
    summary, target = result["summary"], result["config"]["target_model"]
    assert summary["completed"] == 3 and summary["failed"] == 0, summary["errors"]
    assert summary["kv_bytes_per_token"] == runtime_kv, (summary["kv_bytes_per_token"], runtime_kv)
    assert "GetServerInfo" in target["kv_bytes_source"], target
