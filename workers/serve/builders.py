"""The engines `deepseek-pd serve` builds, one builder per role, from the resolved `ServeConfig`.

This is the one module that knows both roles' engine classes (the shared folders, workers/engine,
transport, group, api and metrics, know neither). A builder loads the model (`ModelRunner`, which sizes the KV pool), then builds the role's
engine around it; the engine is started by the caller (worker_main.serve_worker), which also passes the process's
`WorkerMetrics` (workers/metrics/worker_metrics.py) that the engine feeds.

    engine = BUILDERS[config.role](config, metrics)
"""
from __future__ import annotations

from typing import Callable

from deepseek_pd.model.checkpoint.model_dir import load_tokenizer
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.workers.engine.interface import WorkerEngine
from deepseek_pd.workers.engine.model_stream import KernelPriority, model_stream
from deepseek_pd.workers.engine.model_thread import ModelThread
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.serve.config import ServeConfig
from deepseek_pd.workers.serve.roles import role_defaults
from deepseek_pd.workers.decode.engine import DecodeEngine
from deepseek_pd.workers.prefill.engine import PrefillEngine


def _runner(config: ServeConfig, runner: ModelRunner | None, metrics: WorkerMetrics | None) -> ModelRunner:
    """The role's runner (built here unless a group rank passes its own), checked against what
    GetServerInfo will report: the identity's KV bytes per token were resolved before the pool
    existed, by the pool's own rule, and a disagreement would mislead `bench serving`. A recorded
    expert load is handed to the metrics port (/expert_load)."""
    runner = runner or ModelRunner(config.runner)
    reported = config.identity.kv_bytes_per_token
    if reported and reported != runner.kv_pool.bytes_per_token:
        raise RuntimeError(f"the KV pool holds {runner.kv_pool.bytes_per_token} bytes per token, the worker's "
                           f"identity says {reported}")
    if metrics is not None and runner.expert_load is not None:
        recorder = runner.expert_load
        metrics.watch_expert_load(lambda: recorder.dump().to_json())
    return runner


def role_model_thread(role: str, config: ServeConfig, runner: ModelRunner) -> ModelThread:
    """The role's model thread, issuing on the stream of the role's kernel priority
    (roles.py `kernel_priority`) unless `stream_priority` is off."""
    priority = None
    if config.worker.scheduler.stream_priority:
        priority = KernelPriority(role_defaults(role).kernel_priority)
    return ModelThread(f"{role}-model", model_stream(runner.model.options.device, priority))


def build_prefill_engine(config: ServeConfig, metrics: WorkerMetrics | None = None, runner: ModelRunner | None = None,
                         model_thread=None) -> PrefillEngine:
    """`runner` and `model_thread` are given when the engine is one rank of a group (group_main.py)."""
    runner = _runner(config, runner, metrics)
    if model_thread is None:
        model_thread = role_model_thread("prefill", config, runner)
    return PrefillEngine(runner, config.worker, model_thread=model_thread, metrics=metrics)


def build_decode_engine(config: ServeConfig, metrics: WorkerMetrics | None = None, runner: ModelRunner | None = None,
                        model_thread=None) -> DecodeEngine:
    runner = _runner(config, runner, metrics)
    if model_thread is None:
        model_thread = role_model_thread("decode", config, runner)
    # The tokenizer (stop strings) comes from the same model directory the runner loaded.
    return DecodeEngine(runner, config.worker, tokenizer=load_tokenizer(config.model_dir),
                        model_thread=model_thread, metrics=metrics)


BUILDERS: dict[str, Callable[[ServeConfig, WorkerMetrics], WorkerEngine]] = {
    "prefill": build_prefill_engine,
    "decode": build_decode_engine,
}
