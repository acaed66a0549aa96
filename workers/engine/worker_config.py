"""Worker-level settings (frozen), built once from flags and passed down constructors."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.memory_budget import DEFAULT_MAX_RUNNING_REQUESTS
from deepseek_pd.units import GIB
from deepseek_pd.workers.transport.internal_auth import InternalAuth
from deepseek_pd.workers.transport.base import TransportConfig


@dataclass(frozen=True)
class BootstrapConfig:
    """The prefill<->decode channel: where the prefill side listens, and how long anyone waits."""

    host: str = "127.0.0.1"  # bind address of the prefill bootstrap server (0.0.0.0 in a pod)
    port: int = 8998  # 0 picks a free port (tests)
    handshake_timeout_s: float = 30.0  # prefill waits this long for decode's handshake; decode retries this long
    claim_timeout_s: float = 30.0  # a decode handshake waits this long for prefill to get the request
    transfer_timeout_s: float = 300.0  # decode: from handshake to TransferDone (prefill queueing included)
    # prefill: after TransferDone, how long decode may take to accept the KV (its checks included)
    # and half-close; under load this is seconds, and giving up fails a request decode holds.
    confirm_timeout_s: float = 30.0
    event_queue_depth: int = 8  # KV chunks in flight per room before the prefill side waits
    retry_initial_s: float = 0.05  # decode's connect backoff starts here and doubles ...
    retry_max_s: float = 1.0  # ... up to this
    # The deployment secret that signs every handshake/ack/done/abort (internal_auth.py); the
    # default is this process's own random secret, so only engines of one process meet.
    auth: InternalAuth = field(default_factory=InternalAuth)
    # decode: the only prefill bootstrap addresses ("host:port", a host may be a DNS name whose
    # addresses count too) a request may name; () allows loopback hosts only (decode/prefill_peers.py).
    prefill_peers: tuple[str, ...] = ()
    # prefill: names besides host/advertise_host that decode may dial the bootstrap at, and so
    # name in its tokens (a pod's DNS name through its group's headless Service).
    aliases: tuple[str, ...] = ()
    # This engine's DP rank in its worker group, of `dp_size` (bootstrap_routes.py): a prefill rank
    # refuses the handshake of a room that is not its own; a decode rank names itself in its handshakes.
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("handshake_timeout_s", "claim_timeout_s", "transfer_timeout_s", "retry_initial_s",
                     "retry_max_s", "confirm_timeout_s"):
            if getattr(self, name) <= 0:
                raise UserError(f"bootstrap {name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise UserError(f"bootstrap port {self.port} is not a TCP port")
        if self.event_queue_depth < 1:
            raise UserError(f"event_queue_depth must be >= 1, got {self.event_queue_depth}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise UserError(f"bootstrap DP rank {self.dp_rank} is not a rank of a group of {self.dp_size}")


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
    # decode: launch step N+1 before collecting step N's tokens (workers/decode/engine.py); same tokens
    overlap_schedule: bool = True
    # decode with speculation: collect step N and launch step N+1 in one model-thread call, so the
    # device runs N+1 while the event loop streams N's tokens (workers/decode/engine.py); same tokens
    speculative_overlap: bool = False
    # `--deterministic`: prompts cut only at multiples of chunked_prefill_size from their own start
    # (prefill_planner `aligned`), and no prefix cache (a hit would start a prompt's extend at the
    # cached length, i.e. cut it elsewhere than a cold run does).
    deterministic: bool = False
    # prefill sharing a GPU with decode: bound each round to about this long by sizing its token
    # budget from measured rounds (workers/prefill/round_budget.py); 0: off, every round may take
    # chunked_prefill_size tokens
    prefill_round_target_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.chunked_prefill_size < 1:
            raise UserError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.max_running_requests < 1:
            raise UserError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.decode_reserve_tokens < 0 or self.admission_timeout_s <= 0:
            raise UserError("decode_reserve_tokens must be >= 0 and admission_timeout_s > 0")
        if self.prefill_round_target_ms < 0:
            raise UserError(f"prefill_round_target_ms must be >= 0, got {self.prefill_round_target_ms}")
        if self.deterministic and self.prefill_round_target_ms:
            raise UserError("deterministic mode cuts prompts at multiples of a fixed chunk: it cannot size "
                            "rounds by time (prefill_round_target_ms); set one of them")
        if self.deterministic and self.prefix_cache:
            raise UserError("deterministic mode runs without the prefix cache (a hit cuts a prompt elsewhere "
                            "than a cold run); set prefix_cache off")



@dataclass(frozen=True)
class WorkerConfig:
    """Everything a prefill or decode engine needs besides the model runner."""

    kv_transport: str = "grpc"  # a name from kv_transfer.TRANSPORT_NAMES
    transport: TransportConfig = field(default_factory=TransportConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        from deepseek_pd.workers.transport import TRANSPORT_NAMES
        if self.kv_transport not in TRANSPORT_NAMES:
            raise UserError(f"unknown KV transport {self.kv_transport!r}; choose one of {', '.join(TRANSPORT_NAMES)}")
