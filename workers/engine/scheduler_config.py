"""The engine's scheduling limits (frozen `SchedulerConfig`), and the GPU's default prompt chunk.

A worker's whole config, which adds the PD handoff's settings (its KV transport, the bootstrap
channel), is `WorkerConfig` in workers/transport/worker_config.py: the engine core knows no transport.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_pd.bounds import Bounds, bounds_blocker
from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.memory_budget import DEFAULT_MAX_RUNNING_REQUESTS
from deepseek_pd.units import GIB


# Prefill tokens per extend batch on a GPU, by its total memory, as SGLang chooses them: larger rounds
# batch more prompts per forward where memory allows. On the H200 (141 GB) 8192 against 2048 gave
# +12% output tok/s at c=64, with lower TTFT and TPOT (docs/performance.md, 2026-12-04). The total is
# NVML's, as SGLang's is nvidia-smi's: a little above what CUDA can allocate (model/nvml.py says why).
GPU_CHUNK_TIERS: tuple[tuple[int, int], ...] = ((35 * GIB, 2048), (160 * GIB, 8192))  # (below bytes, tokens)
LARGEST_GPU_CHUNK = 16384


def gpu_chunked_prefill_size(total_memory_bytes: int | None) -> int:
    """The default chunked_prefill_size on a GPU of this much memory (None, not known: the CPU's)."""
    if total_memory_bytes is None:
        return SchedulerConfig.chunked_prefill_size
    for below, tokens in GPU_CHUNK_TIERS:
        if total_memory_bytes < below:
            return tokens
    return LARGEST_GPU_CHUNK


# `SchedulerConfig`'s numeric fields with a range (deepseek_pd/bounds.py): the config applies them, and
# `serve` before any worker starts (`--chunked-prefill-size`: its flag rules; the others: engine options).
SCHEDULER_BOUNDS = {
    "chunked_prefill_size": Bounds(1),
    "max_running_requests": Bounds(1),
    "decode_reserve_tokens": Bounds(0),
    "admission_timeout_s": Bounds(0, open_low=True),
    "prefill_round_target_ms": Bounds(0),  # 0: off
    "layerwise_min_bytes": Bounds(0),  # 0: every layer its own send
}


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of one worker's engine."""

    # Prompt tokens per extend batch, summed over requests (on a GPU, `serve` defaults to
    # gpu_chunked_prefill_size of its memory).
    chunked_prefill_size: int = 2048
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS  # decode batch size cap (= the largest CUDA-graph bucket by default)
    decode_reserve_tokens: int = 4096  # pages reserved per request for decoding: min(max_new_tokens, this)
    admission_timeout_s: float = 30.0  # a request waits this long for KV pages before RESOURCE_EXHAUSTED
    prefix_cache: bool = True  # prefill: reuse KV of shared prompt prefixes (radix tree)
    # prefill: hand each layer's KV to the transport as soon as the forward has written it, so
    # the transfer overlaps the remaining layers (workers/prefill/engine.py); off: after each chunk
    layerwise_transfer: bool = True
    # prefill, layer-wise: one hand-off to the transport carries at least this many bytes of KV (a
    # round's layers are handed over in groups that reach it; the last layer's group goes whatever
    # its size), so a short prompt's forward is not interleaved with a send per layer. Each send is
    # Python on the event loop and the KV threads that the model thread waits for (the GIL: it gives
    # it up at every op): 27 sends took 0.27 of the forward's own CPU, 6 sends 0.10
    # (workers/prefill/layer_relay.py). 8 MiB: an 8k-token V2-Lite prompt (9.4 MB a layer) still
    # streams layer by layer, a 789-token one goes in 3 sends. 0: every layer its own send.
    layerwise_min_bytes: int = 8 << 20
    # decode: launch step N+1 before collecting step N's tokens (workers/decode/engine.py); same tokens
    overlap_schedule: bool = True
    # decode with speculation: collect step N and launch step N+1 in one model-thread call, so the
    # device runs N+1 while the event loop streams N's tokens (workers/decode/engine.py); same tokens.
    # On by default, as in the offline engine (its launch-ahead passed its GPU test, 2026-12-07); a
    # void row of a step launched ahead (its request ended in the step before) counts neither in the
    # accept-length metric nor in the expert load (ForwardBatch.counted_tokens).
    speculative_overlap: bool = True
    # `--deterministic`: prompts cut only at multiples of chunked_prefill_size from their own start
    # (prefill_planner `aligned`), and no prefix cache (a hit would start a prompt's extend at the
    # cached length, i.e. cut it elsewhere than a cold run does).
    deterministic: bool = False
    # prefill sharing a GPU with decode: bound each round to about this long by sizing its token
    # budget from measured rounds (workers/prefill/round_budget.py); 0: off, every round may take
    # chunked_prefill_size tokens
    prefill_round_target_ms: float = 0.0
    # on CUDA, the model thread issues on a stream of its role's priority (decode's before prefill's
    # on a shared GPU: workers/serve/roles.py `kernel_priority`); off (the default): the default
    # stream. Off because it bought nothing on an H100 (bench/stream_priority.py, 2026-12-07: a
    # decode-shaped step beside a GEMM load took x16.8 of alone at the same priority and x16.8 at the
    # greatest in one process, x14.4 and x15.3 under MPS: a running GEMM's blocks are not preempted)
    stream_priority: bool = False

    def __post_init__(self) -> None:
        if (blocker := bounds_blocker(SCHEDULER_BOUNDS, **{name: getattr(self, name)
                                                           for name in SCHEDULER_BOUNDS})) is not None:
            raise UserError(blocker)
        if self.deterministic and self.prefill_round_target_ms:
            raise UserError("deterministic mode cuts prompts at multiples of a fixed chunk: it cannot size "
                            "rounds by time (prefill_round_target_ms); set one of them")
        if self.deterministic and self.prefix_cache:
            raise UserError("deterministic mode runs without the prefix cache (a hit cuts a prompt elsewhere "
                            "than a cold run); set prefix_cache off")
