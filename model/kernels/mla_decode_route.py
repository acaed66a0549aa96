"""Which kernel runs absorbed-MLA decode: the rule behind attention backend "auto" and, inside the
"flashinfer" backend, behind each decode batch. Torch-free, so that whatever decides a backend
before a rank exists (`RunnerConfig.resolve`, model/jit_backends.py's fallback) applies these words.

Two decisions, each made once here:

    auto_attention_backend   the backend "auto" names for a model on a host: "flashinfer" where
                             FlashInfer's MLA decode can run here and can win at this model's shape
                             on one rank, else "triton" on CUDA (Triton imports), else "torch";
                             with the reason, which the runner logs.
    MLADecodeRoute           within "flashinfer", which decode batches go to FlashInfer's kernel
                             (the rest run our Triton kernel, which the backend inherits).

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

Example (V3, bf16, FlashInfer installed with nvcc, CUDA):
    auto_attention_backend(AttentionHost(True, True, None), heads_per_rank=128, ...)
        -> ("flashinfer", "FlashInfer's MLA decode at 128 heads per rank, batches of 4 or more")
    the same at tp 8 (16 heads per rank) -> ("triton", "... FlashInfer does not win at 16 heads per rank")
"""
from __future__ import annotations

from dataclasses import dataclass

# The latent and rope widths FlashInfer's MLA kernels are compiled for (DeepSeek-V2/V3).
FLASHINFER_WIDTHS = (512, 64)
FLASHINFER_DTYPES = ("bfloat16", "float16")
NEVER = 1 << 30  # a batch size no decode step reaches


@dataclass(frozen=True)
class MLADecodeRoute:
    """Which decode batches go to FlashInfer: at least `min_batch_many_heads` sequences when a
    rank holds `many_heads` heads or more (V3: 128), at least `min_batch_few_heads` below that
    (V2-Lite: 16; `NEVER`: equal at batch 128, and Triton needs no per-batch host plan).

    Example: route = MLADecodeRoute(); route.uses_flashinfer(128, 1) → False; (128, 32) → True.
    """

    many_heads: int = 64
    min_batch_many_heads: int = 4
    min_batch_few_heads: int = NEVER

    def min_batch(self, heads: int) -> int:
        """The smallest decode batch that goes to FlashInfer at `heads` heads per rank."""
        return self.min_batch_many_heads if heads >= self.many_heads else self.min_batch_few_heads

    def uses_flashinfer(self, heads: int, batch: int) -> bool:
        return batch >= self.min_batch(heads)

    def ever_uses_flashinfer(self, heads: int) -> bool:
        """Whether some decode batch at `heads` heads per rank goes to FlashInfer."""
        return self.min_batch(heads) < NEVER


@dataclass(frozen=True)
class AttentionHost:
    """What "auto" asks of the machine: a CUDA device, Triton importable, and why FlashInfer's MLA
    decode cannot run here (None: it may; its kernel is then compiled and run once at start-up,
    model/jit_backends.py, and "auto" falls back to Triton where that fails)."""

    cuda: bool
    triton: bool
    flashinfer_blocker: str | None


def auto_attention_backend(host: AttentionHost, *, heads_per_rank: int, widths: tuple[int, int], dtype: str,
                           deterministic: bool = False, route: MLADecodeRoute = MLADecodeRoute()) -> tuple[str, str]:
    """(backend name, why) for attention backend "auto": `widths` the model's (kv_lora_rank,
    qk_rope_head_dim), `dtype` the resolved activation dtype's name, `deterministic` whether the
    batch-invariant kernels run (FlashInfer has no batch-invariant version)."""
    if not host.cuda:
        return "torch", "no CUDA device: the plain-torch reference"
    if not host.triton:
        return "torch", "Triton does not import: the plain-torch reference"
    if host.flashinfer_blocker is not None:
        return "triton", f"Triton's MLA decode: {host.flashinfer_blocker}"
    if deterministic:
        return "triton", "Triton's MLA decode: FlashInfer's has no batch-invariant version (deterministic)"
    if tuple(widths) != FLASHINFER_WIDTHS:
        return "triton", f"Triton's MLA decode: FlashInfer's is built for latent + rope {FLASHINFER_WIDTHS}, " \
                         f"not {tuple(widths)}"
    if dtype not in FLASHINFER_DTYPES:
        return "triton", f"Triton's MLA decode: FlashInfer's runs {' or '.join(FLASHINFER_DTYPES)}, not {dtype}"
    if not route.ever_uses_flashinfer(heads_per_rank):
        return "triton", f"Triton's MLA decode: FlashInfer does not win at {heads_per_rank} heads per rank"
    return "flashinfer", (f"FlashInfer's MLA decode at {heads_per_rank} heads per rank, batches of "
                          f"{route.min_batch(heads_per_rank)} or more (Triton below)")
