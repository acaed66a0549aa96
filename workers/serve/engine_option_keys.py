"""Every `--engine-opt` key, in one torch-free table: its name, the type its value is parsed as (for a
string setting: the tuple of values it may take), and the worker configs that hold a field of that name.

The configs themselves (`RunnerConfig`, `BootstrapConfig`, `SchedulerConfig`, `TransportConfig`,
`GroupLayout`) import torch or the transports, which the operator and the CLI's argument checks may
not; so the keys live here, and `serve` fills the configs from this table
(workers/serve/engine_options.py `assign_engine_options`). `serve`'s flag rules refuse an unknown key,
a value of the wrong type, or a name that is none of a string setting's values (the configs' own
tuples: model/runner_rules.py `RUNNER_CHOICES`, model/kv/same_host_direct.py; checked by
deepseek_pd/choices.py, the rule the configs apply too), or a number out of its config's range
(`ENGINE_OPTION_BOUNDS`, deepseek_pd/bounds.py, the same) before anything loads (workers/serve/flag_rules.py);
the operator applies the same rules to a role's engineArgs (an InvalidSpec condition) and `up` to its `--worker-arg`s.
tests/workers/test_engine_option_keys.py fails when a config field and this table drift apart.

A config field that `serve` sets from a flag of its own (`--page-size`, `--port`, ...) is not an
engine option (workers/serve/resolution.py `_FLAG_FIELDS`). `deterministic` is the one key two
configs hold: the runner's kernels and the scheduler's cuts.

Example: `ENGINE_OPTION_KEYS["scheduler"]["max_running_requests"] is int`,
`ENGINE_OPTION_KEYS["transport"]["same_host_direct"] == ("auto", "on", "off")`, and
`targets_of("deterministic") == ("runner", "scheduler")`.
"""
from __future__ import annotations

from typing import Mapping, Union

from deepseek_pd.bounds import Bounds
from deepseek_pd.model.runner_rules import RUNNER_BOUNDS, RUNNER_CHOICES
from deepseek_pd.model.kv.mooncake_direction import MOONCAKE_KV_DIRECTIONS
from deepseek_pd.model.kv.same_host_direct import SAME_HOST_DIRECT_MODES
from deepseek_pd.transfer_limits import BOOTSTRAP_BOUNDS, TRANSPORT_BOUNDS
from deepseek_pd.workers.engine.scheduler_config import SCHEDULER_BOUNDS
from deepseek_pd.workers.group.layout import GROUP_BOUNDS

# How a value is parsed: a type (bool: true/false/1/0/yes/no), or the names a string setting may take.
Kind = Union[type, tuple[str, ...]]

# target (the config it sets) -> key -> its kind
ENGINE_OPTION_KEYS: Mapping[str, Mapping[str, Kind]] = {
    "runner": {  # model/runner_config.py RunnerConfig
        "mem_headroom_gib": float, "mha_chunked_kv_threshold": int,
        "prefix_chunk_size": int, "num_fused_shared_experts": int, **RUNNER_CHOICES, "low_latency_max_tokens": int,
        "ep_size": int, "tp_size": int, "enable_tbo": bool, "tbo_token_distribution_threshold": float,
        "tbo_min_decode_tokens": int, "tbo_min_extend_tokens": int, "record_expert_load": bool,
        "cuda_graph": bool, "cuda_graph_max_batch": int, "cuda_graph_max_context": int,
        "extend_cuda_graph": bool, "extend_graph_max_tokens": int,
        "speculative_num_steps": int, "speculative_adaptive": bool,
        "deterministic": bool, "small_batch_fusions": bool,
    },
    "bootstrap": {  # workers/transport/bootstrap_config.py BootstrapConfig
        "handshake_timeout_s": float, "claim_timeout_s": float, "transfer_timeout_s": float,
        "confirm_timeout_s": float, "event_queue_depth": int, "retry_initial_s": float, "retry_max_s": float,
        "dp_rank": int, "dp_size": int,
    },
    "scheduler": {  # workers/engine/scheduler_config.py SchedulerConfig
        "max_running_requests": int, "decode_reserve_tokens": int, "admission_timeout_s": float,
        "prefix_cache": bool, "layerwise_transfer": bool, "layerwise_min_bytes": int, "overlap_schedule": bool, "deterministic": bool,
        "prefill_round_target_ms": float, "speculative_overlap": bool, "stream_priority": bool,
    },
    "transport": {  # workers/transport/base.py TransportConfig
        "max_chunk_bytes": int, "io_threads": int, "grpc_streams": int, "same_host_direct": SAME_HOST_DIRECT_MODES,
        "send_timeout_s": float, "mooncake_staging_tokens": int, "mooncake_kv_direction": MOONCAKE_KV_DIRECTIONS,
    },
    "group": {  # workers/group/layout.py GroupLayout
        "collective_timeout_s": float, "startup_timeout_s": float,
    },
}


# A numeric key's range, the configs' own bounds (deepseek_pd/bounds.py): `--chunked-prefill-size` is a
# flag of its own, not an engine option (serve's flag rules check it with the same bounds).
ENGINE_OPTION_BOUNDS: Mapping[str, Bounds] = {
    key: bounds for key, bounds in {**RUNNER_BOUNDS, **SCHEDULER_BOUNDS, **TRANSPORT_BOUNDS, **BOOTSTRAP_BOUNDS,
                          **GROUP_BOUNDS}.items()
    if key != "chunked_prefill_size"}


def kind_of(key: str) -> Kind | None:
    """How `key`'s value is parsed (a type, or the names it may take); None when no config has such a field."""
    for keys in ENGINE_OPTION_KEYS.values():
        if key in keys:
            return keys[key]
    return None


def targets_of(key: str) -> tuple[str, ...]:
    """The configs (table order) that hold a field named `key`."""
    return tuple(target for target, keys in ENGINE_OPTION_KEYS.items() if key in keys)


def all_keys() -> list[str]:
    """Every key, sorted (what an error about an unknown key lists)."""
    return sorted({key for keys in ENGINE_OPTION_KEYS.values() for key in keys})
