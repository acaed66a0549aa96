"""Which kernel runs absorbed-MLA decode: the rule behind attention backend "auto" and, inside the
"flashinfer" and "flashmla" backends, behind each decode batch. Torch-free, so that whatever decides
a backend before a rank exists (`RunnerConfig.resolve`, model/jit_backends.py's fallback) applies
these words.

Three decisions, each made once here:

    auto_attention_backend   the backend "auto" names for a model on a host: the first library of
                             `AUTO_LIBRARIES` that can run here and can win at this model's shape on
                             one rank, else "triton" on CUDA (Triton imports), else "torch"; with
                             the reason, which the runner logs.
    MLADecodeRoute           within a library's backend, which decode batches go to the library's
                             kernel (the rest run our Triton kernel, which the backend inherits):
                             `FLASHINFER_ROUTE`, `FLASHMLA_ROUTE`, the measured table.
    named_library_blocker    why a library's backend that a user names cannot run here (a clear
                             error before the model is built, not a silent Triton).

Measured on one H100 (docs/performance.md, 2026-12-06; FlashInfer 0.7.2.post1, fa3, page 64): at
V3's 128 heads FlashInfer's kernel is 3.4-6.6x ours at every shape that ran (bs 128 x 2.3k: 0.163
against 0.90 ms per layer), and it plans each batch on the host once for all layers (0.6-7 ms);
at V2-Lite's 16 heads, batch 128, the two kernels are equal. Re-measured 2026-12-07 (H100, the
`mla_route` part of bench/fp8_prefill_gpu.py, per layer): at 128 heads, 1 sequence of 1.9k tokens,
Triton 0.025 against FlashInfer 0.022 ms plus a 0.8 ms plan, Triton wins the step; at 4 sequences
(7.1k tokens) 0.101 against 0.030 ms plus a 0.34 ms plan, FlashInfer wins a 61-layer step by about
4 ms; at 16 heads FlashInfer is at most 10% ahead at 8-32 sequences, less than its plan costs. Hence:
FlashInfer for batches of 4 or more at 64 heads or more per rank, Triton for the rest (and for every
shape at 16 heads).

FlashMLA (sm90 dense decode, built from source: bench/flashmla_build.sh; Dockerfile.cuda builds it)
measured 2026-12-07 on one H100 (session 15, commit 17c371d, bench/mla_decode_gpu.py, per layer, bf16,
64-token pages, ragged lengths of ~2.3k mean): at 128 heads 0.025 / 0.028 / 0.048 / 0.217 ms at
batch 1 / 4 / 16 / 128 against Triton's 0.110 / 0.066 / 0.148 / 1.104 and FlashInfer's 0.021 /
0.031 / 0.052 / 0.216; at 16 heads 0.023 / 0.025 / 0.033 / 0.144 against Triton's 0.091 / 0.061 /
0.098 / 0.185. It plans nothing on the host (its scheduling metadata is one device kernel on the
lengths, ~0.09 ms once per step, and part of a captured graph), where FlashInfer plans each batch
on the host for 0.9-9 ms. Hence FlashMLA at every batch and head count, and "auto" prefers it to
FlashInfer where both can run; it takes 64-token pages and bf16 only.

Example (V3, bf16, FlashInfer installed with nvcc, FlashMLA not built, CUDA):
    auto_attention_backend(AttentionHost(True, True, None), heads_per_rank=128, ...)
        -> ("flashinfer", "FlashInfer's MLA decode at 128 heads per rank, batches of 4 or more")
    the same at tp 8 (16 heads per rank) -> ("triton", "... FlashInfer does not win at 16 heads per rank")
"""
from __future__ import annotations

from dataclasses import dataclass

# The latent and rope widths FlashInfer's and FlashMLA's MLA kernels are compiled for (DeepSeek-V2/V3).
FLASHINFER_WIDTHS = (512, 64)
FLASHINFER_DTYPES = ("bfloat16", "float16")
FLASHMLA_WIDTHS = FLASHINFER_WIDTHS
FLASHMLA_DTYPES = ("bfloat16",)  # its fp16 kernel is left out of our build (scripts/flashmla_setup.py)
FLASHMLA_PAGE_SIZE = 64  # its paged kernel's one block size
NEVER = 1 << 30  # a batch size no decode step reaches


@dataclass(frozen=True)
class MLADecodeRoute:
    """Which decode batches go to a library's kernel: at least `min_batch_many_heads` sequences
    when a rank holds `many_heads` heads or more (V3: 128), at least `min_batch_few_heads` below
    that (V2-Lite: 16; `NEVER`: FlashInfer and Triton are equal at batch 128, and Triton needs no
    per-batch host plan).

    Example: route = MLADecodeRoute(); route.uses_library(128, 1) → False; (128, 32) → True.
    """

    many_heads: int = 64
    min_batch_many_heads: int = 4
    min_batch_few_heads: int = NEVER

    def min_batch(self, heads: int) -> int:
        """The smallest decode batch that goes to the library at `heads` heads per rank."""
        return self.min_batch_many_heads if heads >= self.many_heads else self.min_batch_few_heads

    def uses_library(self, heads: int, batch: int) -> bool:
        return batch >= self.min_batch(heads)

    def ever_uses_library(self, heads: int) -> bool:
        """Whether some decode batch at `heads` heads per rank goes to the library."""
        return self.min_batch(heads) < NEVER


# The measured table (module docstring): which decode batches each library's backend sends to it.
FLASHINFER_ROUTE = MLADecodeRoute()
# Measured (module docstring): faster than Triton at every batch, at 128 and at 16 heads.
FLASHMLA_ROUTE = MLADecodeRoute(many_heads=64, min_batch_many_heads=1, min_batch_few_heads=1)
# The libraries "auto" may pick, most preferred first: FlashMLA (no host plan) where it is built.
AUTO_LIBRARIES: tuple[str, ...] = ("flashmla", "flashinfer")
_LIBRARY_NAMES = {"flashinfer": "FlashInfer", "flashmla": "FlashMLA"}


@dataclass(frozen=True)
class AttentionHost:
    """What "auto" asks of the machine: a CUDA device, Triton importable, and why FlashInfer's MLA
    decode cannot run here (None: it may; its kernel is then compiled and run once at start-up,
    model/jit_backends.py, and "auto" falls back to Triton where that fails); likewise FlashMLA's
    (None: `flash_mla` is installed or carried; its start-up check runs when its backend is built)."""

    cuda: bool
    triton: bool
    flashinfer_blocker: str | None
    flashmla_blocker: str | None = "FlashMLA was not looked for"

    def blocker(self, library: str) -> str | None:
        return self.flashinfer_blocker if library == "flashinfer" else self.flashmla_blocker


def kv_blocker(library: str, host: AttentionHost, *, widths: tuple[int, int], dtype: str) -> str | None:
    """Why `library`'s MLA decode kernel cannot read this model's latent KV here (the library is
    missing on `host`, or the KV's `widths` (kv_lora_rank, qk_rope_head_dim) or `dtype` are not
    its); None: it can. What the page-size default asks (model/kv/page_size.py): nothing of the
    role, the route or the batch-invariant mode."""
    name = _LIBRARY_NAMES[library]
    widths_ok, dtypes = (FLASHINFER_WIDTHS, FLASHINFER_DTYPES) if library == "flashinfer" else \
        (FLASHMLA_WIDTHS, FLASHMLA_DTYPES)
    if (blocker := host.blocker(library)) is not None:
        return blocker
    if tuple(widths) != widths_ok:
        return f"{name}'s is built for latent + rope {widths_ok}, not {tuple(widths)}"
    if dtype not in dtypes:
        return f"{name}'s runs {' or '.join(dtypes)}, not {dtype}"
    return None


def library_blocker(library: str, host: AttentionHost, *, heads_per_rank: int, widths: tuple[int, int],
                    dtype: str, deterministic: bool = False, page_size: int | None = None,
                    route: MLADecodeRoute | None = None) -> str | None:
    """Why `library`'s MLA decode ("flashinfer" or "flashmla") cannot serve this model here, or
    cannot win at its shape (`route`: the library's route, its measured one by default); None: it
    can. `page_size` None: not known yet (FlashMLA needs 64-token pages)."""
    name = _LIBRARY_NAMES[library]
    route = route or (FLASHINFER_ROUTE if library == "flashinfer" else FLASHMLA_ROUTE)
    if (blocker := host.blocker(library)) is not None:
        return blocker
    if deterministic:
        return f"{name}'s has no batch-invariant version (deterministic)"
    if (blocker := kv_blocker(library, host, widths=widths, dtype=dtype)) is not None:
        return blocker
    if library == "flashmla" and page_size is not None and page_size != FLASHMLA_PAGE_SIZE:
        return (f"FlashMLA's takes pages of {FLASHMLA_PAGE_SIZE} tokens, not the {page_size} given "
                f"(leave --page-size unset, or give {FLASHMLA_PAGE_SIZE}, to run it)")
    if not route.ever_uses_library(heads_per_rank):
        return f"{name} does not win at {heads_per_rank} heads per rank"
    return None


def auto_attention_backend(host: AttentionHost, *, heads_per_rank: int, widths: tuple[int, int], dtype: str,
                           deterministic: bool = False, page_size: int | None = None,
                           route: MLADecodeRoute = FLASHINFER_ROUTE, flashmla_route: MLADecodeRoute = FLASHMLA_ROUTE,
                           libraries: tuple[str, ...] = AUTO_LIBRARIES) -> tuple[str, str]:
    """(backend name, why) for attention backend "auto": `widths` the model's (kv_lora_rank,
    qk_rope_head_dim), `dtype` the resolved activation dtype's name, `deterministic` whether the
    batch-invariant kernels run (neither library has a batch-invariant version), `page_size` the KV
    pool's, `route`/`flashmla_route` each library's table, `libraries` those "auto" may pick, in
    order of preference."""
    if not host.cuda:
        return "torch", "no CUDA device: the plain-torch reference"
    if not host.triton:
        return "torch", "Triton does not import: the plain-torch reference"
    routes = {"flashinfer": route, "flashmla": flashmla_route}
    reasons = []
    for library in libraries:
        why_not = library_blocker(library, host, heads_per_rank=heads_per_rank, widths=widths, dtype=dtype,
                                  deterministic=deterministic, page_size=page_size, route=routes[library])
        if why_not is None:
            return library, (f"{_LIBRARY_NAMES[library]}'s MLA decode at {heads_per_rank} heads per rank, batches "
                             f"of {routes[library].min_batch(heads_per_rank)} or more (Triton below)")
        reasons.append(why_not)
    return "triton", "Triton's MLA decode: " + ("; ".join(reasons) or "no kernel library is tried")


def named_library_blocker(backend: str, host: AttentionHost, page_size: int) -> str | None:
    """Why attention backend `backend`, named by the user, cannot run on `host` with `page_size`
    pages: a clear error, where "auto" would quietly run Triton. None for a backend that needs no
    library, or one that can run (FlashMLA's start-up check still runs when its backend is built)."""
    if backend != "flashmla":
        return None
    prefix = "attention backend 'flashmla' (FlashMLA's sm90 MLA decode)"
    if not host.cuda:
        return f"{prefix} needs a CUDA device (a Hopper GPU); use 'auto', 'triton' or 'torch'"
    if host.flashmla_blocker is not None:
        return f"{prefix}: {host.flashmla_blocker}; use 'auto' or 'triton'"
    if page_size != FLASHMLA_PAGE_SIZE:
        return f"{prefix} needs page_size {FLASHMLA_PAGE_SIZE} (its kernel's block size), got {page_size}"
    return None
