"""Every environment variable the project reads, typed, in one place. Nothing else reads os.environ.

Add a field here (with its default and a comment saying why it exists) rather than calling
os.environ elsewhere.
"""
from __future__ import annotations

import os
from pathlib import Path


def _get(name: str, default: str) -> str:
    return os.environ.get(name, default)


def cache_dir() -> Path:
    """Where generated artefacts (the embedded tiny model) live. DEEPSEEK_PD_CACHE overrides."""
    default = Path(_get("XDG_CACHE_HOME", str(Path.home() / ".cache"))) / "deepseek-pd"
    return Path(_get("DEEPSEEK_PD_CACHE", str(default)))


def log_level() -> str:
    """DEEPSEEK_PD_LOG_LEVEL: logging level name for workers and the launcher."""
    return _get("DEEPSEEK_PD_LOG_LEVEL", "INFO").upper()


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton's own switch to run kernels on CPU tensors through its interpreter.

    Read here so the kernel wrappers can accept CPU tensors only when Triton will interpret them
    (kernel tests on machines without a GPU); Triton itself reads the same variable.
    """
    return _get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as set (None when unset): which GPUs CUDA numbers, for the NVML reading
    of a GPU's memory before any CUDA context exists (model/nvml.py)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def flashmla_dir() -> str | None:
    """DEEPSEEK_PD_FLASHMLA_DIR: a folder holding a built `flash_mla` package (bench/flashmla_build.sh
    writes one under its $OUT: carried into a later device call instead of rebuilding it), imported
    when no installed `flash_mla` is (model/kernels/flashmla_mla.py). None when unset."""
    return os.environ.get("DEEPSEEK_PD_FLASHMLA_DIR") or None


# The ports Mooncake's engines draw from by default: MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, BOTH ends
# included (its findAvailableTcpPort draws `min + rand % (max - min + 1)`, 0.3.13.post1).
MOONCAKE_RPC_PORTS = range(15000, 17000 + 1)
# What Mooncake's ValidatePortRange accepts for either end; a range it refuses falls back to the
# default as a whole (config.cpp, 0.3.13.post1).
_MOONCAKE_PORT_FLOOR, _MOONCAKE_PORT_CEIL = 1024, 65535
_MOONCAKE_REFUSED = range(32768, 60999 + 1)  # Linux's default ephemeral range


def mooncake_rpc_ports() -> range:
    """MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (both included): where Mooncake's TransferEngine draws its
    listening ports (handshake RPC and TCP transport) at random; local port picks stay out of it
    (deepseek_pd/ports.py). Read as Mooncake reads it: an end it cannot use (malformed, below 1024,
    inside 32768-60999, or min > max) makes it fall back to the whole default range."""
    default = MOONCAKE_RPC_PORTS
    ends = []
    for name, fallback in (("MC_MIN_RPC_PORT", default.start), ("MC_MAX_RPC_PORT", default[-1])):
        try:
            ends.append(int(_get(name, str(fallback))))
        except ValueError:
            return default  # Mooncake's atoi gives 0 here, which it refuses
    low, high = ends
    usable = [_MOONCAKE_PORT_FLOOR <= p <= _MOONCAKE_PORT_CEIL and p not in _MOONCAKE_REFUSED for p in ends]
    return range(low, high + 1) if all(usable) and low <= high else default


def hf_token() -> str | None:
    """HF_TOKEN: the Hugging Face token `deepseek-pd download` sends (in a pod, from the Secret
    named by model.source.huggingFace.tokenSecret); None when unset or empty."""
    return _get("HF_TOKEN", "").strip() or None


INTERNAL_SECRET_FILE = "DEEPSEEK_PD_INTERNAL_SECRET_FILE"


def internal_secret_file() -> str | None:
    """DEEPSEEK_PD_INTERNAL_SECRET_FILE: the deployment secret's file when `serve` has no
    --internal-secret-file (the operator's pods set it to the mounted Secret); None when unset or empty."""
    return _get(INTERNAL_SECRET_FILE, "").strip() or None


def named_variable(name: str) -> str:
    """The variable a command line names (the router pod's postStart hook names the one holding the
    control-plane key, `python -m deepseek_pd.gateway_guard --key-env`); "" when unset."""
    return _get(name, "")


def omp_num_threads() -> str | None:
    """OMP_NUM_THREADS as the user set it (torch's and OpenMP's own thread count); None when unset or
    empty, where the worker sizes its threads from its CPUs (deepseek_pd/cpu_budget.py)."""
    return _get("OMP_NUM_THREADS", "").strip() or None
