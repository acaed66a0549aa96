"""`deepseek-pd serve` flags -> one resolved `ServeConfig` (workers/serve/resolution.py), parsed by
the real command-line parser. `torch.cuda.is_available` is patched to play a GPU machine: nothing is
loaded, the checkpoint's config.json is all that is read.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.errors import UserError
from deepseek_pd.model import runner_config as runner_config_module
from deepseek_pd.model.kv.pool_sizing import DEFAULT_MEM_FRACTION_STATIC
from deepseek_pd.model.runner_config import DEFAULT_NUM_PAGES
from deepseek_pd.model.checkpoint.tiny import tiny_config
from deepseek_pd.workers.serve.roles import ROLES
from deepseek_pd.workers.serve.resolution import resolve_serve_config


@pytest.fixture
def gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner_config_module, "_triton_available", lambda: True)


@pytest.fixture
def cpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def checkpoint(tmp_path: Path, torch_dtype: str = "bfloat16", fp8: bool = False) -> Path:
    """A config.json-only checkpoint directory (resolution reads nothing else)."""
    directory = tmp_path / f"ckpt-{torch_dtype}-{fp8}"
    directory.mkdir()
    config = {**tiny_config("v3", 512), "torch_dtype": torch_dtype}
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def resolve(*argv: str):
    return resolve_serve_config(flags_from_args(build_parser().parse_args(["serve", *argv])))


def test_flags_reach_the_resolved_configs(cpu_machine, tmp_path) -> None:
    rng = random.Random()
    model = checkpoint(tmp_path)
    page_size, num_pages = rng.randint(1, 64), rng.randint(1, 5000)
    port, bootstrap = rng.randint(1024, 60000), rng.randint(1024, 60000)
    chunk, running, handshake = rng.randint(1, 4096), rng.randint(1, 256), rng.uniform(0.5, 60)
    role = rng.choice(ROLES)
    config = resolve(role, "--model", str(model), "--page-size", str(page_size), "--num-pages", str(num_pages),
                     "--port", str(port), "--bootstrap-port", str(bootstrap), "--chunked-prefill-size", str(chunk),
                     "--kv-transport", "mooncake", "--engine-opt", f"max_running_requests={running}",
                     "--engine-opt", f"handshake_timeout_s={handshake}", "--engine-opt", "prefix_cache=false",
                     "--engine-opt", "mha_chunked_kv_threshold=7", "--drain-timeout", "3.5")
    assert (config.runner.page_size, config.runner.num_pages, config.runner.mem_fraction_static) == \
        (page_size, num_pages, None)
    assert config.runner.model == str(model) and config.runner.mha_chunked_kv_threshold == 7
    assert (config.identity.role, config.identity.page_size, config.identity.port, config.identity.bootstrap_port,
            config.identity.kv_transport) == (role, page_size, port, bootstrap, "mooncake")
    scheduler = config.worker.scheduler
    assert (scheduler.chunked_prefill_size, scheduler.max_running_requests, scheduler.prefix_cache) == \
        (chunk, running, False)
    assert config.worker.bootstrap.handshake_timeout_s == handshake and config.worker.bootstrap.port == bootstrap
    assert (config.server.port, config.server.drain_timeout_s) == (port, 3.5)
    assert config.model.served_model_name == model.name and config.model_dir == str(model.resolve())


def test_max_total_tokens_rounds_up_to_whole_pages(cpu_machine, tmp_path) -> None:
    rng = random.Random()
    model = checkpoint(tmp_path)
    for _ in range(20):
        page_size, tokens = rng.randint(1, 64), rng.randint(1, 100_000)
        runner = resolve("decode", "--model", str(model), "--page-size", str(page_size),
                         "--max-total-tokens", str(tokens)).runner
        assert runner.num_pages * page_size >= tokens > (runner.num_pages - 1) * page_size


def test_cpu_defaults(cpu_machine, tmp_path) -> None:
    config = resolve(random.choice(ROLES), "--model", str(checkpoint(tmp_path)))
    runner = config.runner
    assert (runner.device, runner.dtype, runner.cuda_graph) == ("cpu", "float32", False)
    assert (runner.num_pages, runner.mem_fraction_static) == (DEFAULT_NUM_PAGES, None)
    assert (runner.attention_backend, runner.moe_backend) == ("torch", "torch")
    assert config.identity.page_size == runner.page_size
    with pytest.raises(UserError, match="--mem-fraction-static sizes the KV pool from GPU memory"):
        resolve("decode", "--model", str(checkpoint(tmp_path, "float16")), "--mem-fraction-static", "0.5")
    with pytest.raises(UserError, match="CUDA is not available"):
        resolve("decode", "--model", str(checkpoint(tmp_path, "float32")), "--device", "cuda")


def test_gpu_defaults_by_role(gpu_machine, tmp_path) -> None:
    stored = random.choice(["bfloat16", "float16", "float32"])
    model = checkpoint(tmp_path, stored)
    for role, graphs in (("prefill", False), ("decode", True)):  # decode captures graphs, prefill none
        runner = resolve(role, "--model", str(model)).runner
        assert (runner.device, runner.dtype) == ("cuda", stored)
        assert (runner.num_pages, runner.mem_fraction_static) == (None, DEFAULT_MEM_FRACTION_STATIC)
        assert runner.cuda_graph is graphs
    assert resolve("decode", "--model", str(model), "--engine-opt", "cuda_graph=false").runner.cuda_graph is False
    assert resolve("decode", "--model", str(model), "--engine-opt",
                   "attention_backend=torch").runner.cuda_graph is False  # not capturable: off, not an error
    with pytest.raises(UserError, match="never decodes"):
        resolve("prefill", "--model", str(model), "--engine-opt", "cuda_graph=true")
    fraction = random.uniform(0.1, 0.9)
    assert resolve("decode", "--model", str(model), "--mem-fraction-static", str(fraction)).runner \
        .mem_fraction_static == fraction
    fixed = resolve("decode", "--model", str(model), "--mem-fraction-static", str(fraction), "--num-pages", "77")
    assert (fixed.runner.num_pages, fixed.runner.mem_fraction_static) == (77, None)  # --num-pages overrides
    on_cpu = resolve("decode", "--model", str(model), "--device", "cpu").runner
    assert (on_cpu.device, on_cpu.dtype, on_cpu.cuda_graph, on_cpu.num_pages) == \
        ("cpu", "float32", False, DEFAULT_NUM_PAGES)


def test_the_largest_cuda_graph_follows_the_decode_batch_cap(gpu_machine, tmp_path, caplog) -> None:
    model = checkpoint(tmp_path)
    default = resolve("decode", "--model", str(model))
    assert default.runner.cuda_graph_max_batch == default.worker.scheduler.max_running_requests
    cap = random.randint(129, 512)
    raised = resolve("decode", "--model", str(model), "--engine-opt", f"max_running_requests={cap}")
    assert (raised.runner.cuda_graph_max_batch, raised.worker.scheduler.max_running_requests) == (cap, cap)
    below = random.randint(1, cap - 1)
    with caplog.at_level("WARNING"):
        pinned = resolve("decode", "--model", str(model), "--engine-opt", f"max_running_requests={cap}",
                         "--engine-opt", f"cuda_graph_max_batch={below}")
    assert pinned.runner.cuda_graph_max_batch == below  # an explicit value wins, with a warning
    assert f"batches above {below} run without CUDA graphs" in caplog.text
    # The headroom grows with the largest graph (model/kv/memory_headroom.py), unless given or no graphs
    assert default.runner.headroom_gib == 2.0 and raised.runner.headroom_gib == 2.0 * cap / 128
    given = round(random.uniform(0.5, 9), 2)
    assert resolve("decode", "--model", str(model), "--engine-opt", f"max_running_requests={cap}",
                   "--engine-opt", f"mem_headroom_gib={given}").runner.headroom_gib == given
    assert resolve("decode", "--model", str(model), "--engine-opt", f"max_running_requests={cap}",
                   "--engine-opt", "cuda_graph=false").runner.headroom_gib == 2.0


def test_fp8_checkpoint_runs_in_bf16_on_gpu(gpu_machine, tmp_path) -> None:
    model = checkpoint(tmp_path, random.choice(["bfloat16", "float32"]), fp8=True)
    assert resolve("decode", "--model", str(model)).runner.dtype == "bfloat16"
    assert resolve("decode", "--model", str(model), "--dtype", "float32").runner.dtype == "float32"


def test_bad_flags_are_user_errors(cpu_machine, tmp_path) -> None:
    model = str(checkpoint(tmp_path))
    for argv, words in [
        (["--engine-opt", "no_such_knob=1"], "valid keys"),
        (["--engine-opt", "page_size=4"], "unknown --engine-opt 'page_size'"),  # a flag, not an option
        (["--engine-opt", "max_running_requests=many"], "expected a int"),
        (["--engine-opt", "mem_headroom_gib=lots"], "expected a float"),  # an `X | None` field
        (["--engine-opt", "novalue"], "KEY=VALUE"),
        (["--dp", "2", "--ep", "3"], "spread over all 2 ranks"),
        (["--dp", "4", "--nnodes", "2"], "needs --dist-init-addr"),
        (["--dp", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "cannot be spread evenly"),
        (["--dp", "2", "--engine-opt", "ep_size=2"], "set by --ep"),
        (["--port", "0"], "not a TCP port"),
        (["--num-pages", "0"], "must be >= 1"),
        (["--page-size", "0"], "page_size"),
    ]:
        with pytest.raises(UserError, match=words):
            resolve("decode", "--model", model, *argv)
    with pytest.raises(SystemExit):  # argparse: the two pool sizes exclude each other
        build_parser().parse_args(["serve", "decode", "--num-pages", "4", "--max-total-tokens", "64"])




def test_unset_page_size_is_flashmlas_on_both_roles_where_it_can_run(gpu_machine, monkeypatch, tmp_path) -> None:
    """On a machine where FlashMLA can run (injected where attention "auto" asks: a Hopper GPU with
    flash_mla built), `serve` with no --page-size runs 64-token pages on both roles, so the KV layouts
    of prefill and decode agree, and the decode worker's "auto" picks FlashMLA; a given page size is
    kept on both (and "auto" runs Triton); the pool from --max-total-tokens is in pages of the
    resolved size; where FlashMLA is not built, 16."""
    from deepseek_pd.model.kernels.mla_decode_route import AttentionHost

    model = tmp_path / "v3-widths"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**tiny_config("v3", 512), "torch_dtype": "bfloat16",
                                                   "kv_lora_rank": 512, "qk_rope_head_dim": 64}))
    monkeypatch.setattr(runner_config_module, "attention_host",
                        lambda device: AttentionHost(True, True, "no FlashInfer here", flashmla_blocker=None))
    tokens = random.randint(1, 100_000)
    for role in ROLES:
        config = resolve(role, "--model", str(model), "--max-total-tokens", str(tokens))
        assert (config.runner.page_size, config.identity.page_size) == (64, 64), role
        assert config.runner.num_pages == -(-tokens // 64)
        assert config.runner.attention_backend == "flashmla"
        given = random.choice([8, 16, 32])
        kept = resolve(role, "--model", str(model), "--page-size", str(given), "--num-pages", "64").runner
        assert (kept.page_size, kept.attention_backend) == (given, "triton")
    monkeypatch.setattr(runner_config_module, "attention_host",
                        lambda device: AttentionHost(True, True, "no FlashInfer here", "flash_mla is not installed"))
    assert resolve(random.choice(ROLES), "--model", str(model), "--num-pages", "64").runner.page_size == 16
