"""The KV page size a worker runs when none is given: the one rule behind every entry point's default
(`serve` and so `up` and the operator's pods, `generate`, the offline engine, `RunnerConfig.resolve`).

FlashMLA's sm90 decode is the fastest MLA decode on Hopper (per layer at 128 heads, batch 128:
0.217 ms against our Triton's 1.104, docs/performance.md session 15), and its paged kernel reads
64-token pages only; our Triton, torch and FlashInfer kernels take any page size. So, as SGLang
forces page_size 64 when its FlashMLA backend is chosen, the default is 64 where FlashMLA's kernel
can read this model's KV here (a CUDA device, `flash_mla` built, a Hopper GPU as far as NVML tells,
the KV in bf16 at V2/V3's 512 + 64 widths: `mla_decode_route.kv_blocker`), else 16. A page size the
user gives is kept; with one other than 64, attention "auto" runs Triton (or FlashInfer) and logs that
FlashMLA takes 64-token pages.

Why the machine and the KV decide it, not the attention backend nor the role: prefill and decode must
hold pages of one size (the bootstrap handshake's KV layout check refuses a request whose sides
differ, workers/transport/base.py `check_layout`, INVALID_ARGUMENT naming both sizes), and the two
share what this rule reads (the model and its KV dtype, already part of that layout; in a
deployment, the image and the kind of GPU), while a backend named for one role, or `--deterministic`,
would not be shared. So both roles resolve one default. Prefill and decode on different kinds of
machine (one Hopper with FlashMLA, one not) must be given one `--page-size`.

So a decode worker that names a backend other than FlashMLA (`attention_backend=triton`) on a
FlashMLA machine still gets 64-token pages, and that is kept on purpose (session 17): the prefill
worker beside it has no decode backend to follow and resolves 64 on the same machine, so letting
decode's backend pick 16 would make every request of an unchanged deployment fail the layout check;
the operator would need a second cross-role rule (backends, on top of `page_size_mismatch`'s page
sizes) to refuse such CRs, and the rule here would stop being one both roles read alike. What 64
costs a non-FlashMLA decode is what it costs FlashMLA (below), not a kernel limit: Triton, torch and
FlashInfer read any page size. A deployment that wants 16 gives `--page-size 16` to both roles.

What 64-token pages change: the prefill worker's radix cache shares whole pages only
(workers/prefill/radix_cache.py), so a cached prefix is matched to a multiple of 64 tokens, not 16
(a hit gives up to 63 tokens back to recompute, where 16-token pages give up to 15), and a request's
last page holds up to 63 unused slots (the pool's fragmentation, at most one page per request).

Example: `auto_page_size(AttentionHost(True, True, None, flashmla_blocker=None), widths=(512, 64),
dtype="bfloat16")` -> `(64, "FlashMLA's MLA decode can run here: ...")`; with `dtype="float32"` ->
`(16, "... FlashMLA's runs bfloat16, not float32")`.
"""
from __future__ import annotations

from deepseek_pd.model.kernels.mla_decode_route import FLASHMLA_PAGE_SIZE, AttentionHost, kv_blocker

DEFAULT_PAGE_SIZE = 16  # KV tokens per page where FlashMLA cannot run: the pool's unit and the transfer unit
# The largest page an unset --page-size can become on some machine: what a plan that cannot see the
# worker's machine counts (the operator's memory plan rounds a pool up to whole pages of it).
LARGEST_AUTO_PAGE_SIZE = max(DEFAULT_PAGE_SIZE, FLASHMLA_PAGE_SIZE)
# What an unset --page-size becomes, in the words every message and help text uses.
UNSET_PAGE_SIZE = f"{FLASHMLA_PAGE_SIZE} where FlashMLA's decode can run, else {DEFAULT_PAGE_SIZE}"


def auto_page_size(host: AttentionHost, *, widths: tuple[int, int], dtype: str) -> tuple[int, str]:
    """(page size, why) for a worker given none: `host` the machine as attention "auto" sees it,
    `widths` the model's (kv_lora_rank, qk_rope_head_dim), `dtype` the resolved KV dtype's name."""
    if not host.cuda:
        return DEFAULT_PAGE_SIZE, "no CUDA device, so no FlashMLA"
    blocker = kv_blocker("flashmla", host, widths=widths, dtype=dtype)
    if blocker is not None:
        return DEFAULT_PAGE_SIZE, f"FlashMLA's MLA decode cannot run here: {blocker}"
    return FLASHMLA_PAGE_SIZE, f"FlashMLA's MLA decode can run here: its kernel reads {FLASHMLA_PAGE_SIZE}-token pages"


def page_size_mismatch(prefill: int | None, decode: int | None) -> str | None:
    """Why prefill and decode given these `--page-size`s (None: not given, so this rule's default)
    could hold pages of different sizes, which fails every request's KV transfer; None when they
    cannot: both given and equal, or neither (one machine's rule gives both the same)."""
    if prefill == decode:
        return None
    def shown(size: int | None) -> str:
        return str(size) if size is not None else f"unset ({UNSET_PAGE_SIZE})"
    return (f"prefill and decode must hold KV pages of one size, and --page-size is {shown(prefill)} on prefill, "
            f"{shown(decode)} on decode: give both the same --page-size, or neither")


def different_pages_hint(prefill: int, decode: int) -> str:
    """What the KV layout check adds when the two sides' (resolved) page sizes differ: the transfer
    moves whole pages and does not re-page, so the request cannot run."""
    return (f"prefill's pages hold {prefill} tokens and decode's {decode}: give both the same --page-size "
            f"(unset, it is {UNSET_PAGE_SIZE}; model/kv/page_size.py)")
