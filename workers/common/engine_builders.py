"""The default engine builders behind `deepseek-pd serve`: flags -> frozen configs -> engine.

`--engine-opt KEY=VALUE` reaches any field of the worker's configs by name (bootstrap timeouts,
scheduler limits, transport settings, runner knobs such as attention_method); the value is parsed
as the field's type. Unknown keys are an error that lists the valid ones, never ignored.

Example: `--engine-opt handshake_timeout_s=5 --engine-opt max_running_requests=32`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from deepseek_pd.errors import UserError
from deepseek_pd.workers.common.engine_factory import WorkerOptions

# Runner fields that have their own `serve` flags, and so are not engine options.
_RUNNER_FLAG_FIELDS = {"model", "dtype", "device", "page_size", "num_pages"}


def _parse(raw: str, default: Any, key: str) -> Any:
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError as exc:
        raise UserError(f"--engine-opt {key}={raw!r}: expected a {type(default).__name__}") from exc
    return raw


def _split_options(options: WorkerOptions, targets: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Assigns each engine option to the one config class that has a field of that name."""
    fields_of = {name: {f.name: f for f in dataclasses.fields(cls) if f.init}
                 for name, cls in targets.items()}
    fields_of["runner"] = {k: v for k, v in fields_of["runner"].items() if k not in _RUNNER_FLAG_FIELDS}
    fields_of["bootstrap"] = {k: v for k, v in fields_of["bootstrap"].items() if k not in ("host", "port")}
    assigned: dict[str, dict[str, Any]] = {name: {} for name in targets}
    for key, raw in options.engine_options.items():
        owners = [name for name, fields in fields_of.items() if key in fields]
        if not owners:
            valid = sorted(k for fields in fields_of.values() for k in fields)
            raise UserError(f"unknown --engine-opt {key!r}; valid keys: {', '.join(valid)}")
        owner = owners[0]
        default = getattr(targets[owner](), key)
        assigned[owner][key] = _parse(raw, default, key)
    return assigned


def _check_single_process(options: WorkerOptions) -> None:
    par = options.parallel
    if not par.is_single_process:
        raise UserError(
            f"--tp {par.tp} --dp {par.dp} --ep {par.ep} --nnodes {par.nnodes}: the {options.role} "
            "engine of this build runs one process per worker; multi-GPU/multi-node workers are "
            "not supported yet (use --tp 1 --dp 1 --ep 1 --nnodes 1)")


def _configs(options: WorkerOptions):
    from deepseek_pd.model.runner import RunnerConfig
    from deepseek_pd.workers.common.kv_transfer.base import TransportConfig
    from deepseek_pd.workers.common.worker_config import BootstrapConfig, SchedulerConfig, WorkerConfig

    targets = {"runner": RunnerConfig, "bootstrap": BootstrapConfig, "scheduler": SchedulerConfig,
               "transport": TransportConfig}
    opts = _split_options(options, targets)
    runner_fields: dict[str, Any] = {"model": options.model_dir, "dtype": options.dtype,
                                     "device": options.device, **opts["runner"]}
    if options.page_size is not None:
        runner_fields["page_size"] = options.page_size
    if options.num_pages is not None:
        runner_fields["num_pages"] = options.num_pages
    scheduler_fields = dict(opts["scheduler"])
    if options.chunked_prefill_size is not None:
        scheduler_fields["chunked_prefill_size"] = options.chunked_prefill_size
    try:
        runner = RunnerConfig(**runner_fields)
        worker = WorkerConfig(
            kv_transport=options.kv_transport,
            transport=TransportConfig(**{"advertise_host": options.advertise_host, **opts["transport"]}),
            bootstrap=BootstrapConfig(**{"host": options.host, "port": options.bootstrap_port,
                                         **opts["bootstrap"]}),
            scheduler=SchedulerConfig(**scheduler_fields))
    except ValueError as exc:  # some configs raise ValueError rather than UserError
        raise UserError(str(exc)) from exc
    return runner, worker


def build_prefill_engine(options: WorkerOptions):
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.workers.prefill.engine import PrefillEngine

    _check_single_process(options)
    runner_config, worker_config = _configs(options)
    return PrefillEngine(ModelRunner(runner_config), worker_config)


def build_decode_engine(options: WorkerOptions):
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.workers.decode.engine import DecodeEngine

    _check_single_process(options)
    runner_config, worker_config = _configs(options)
    return DecodeEngine(ModelRunner(runner_config), worker_config)
