"""FlashInfer's paged absorbed-MLA kernel (optional), behind a thin wrapper that checks its inputs.

FlashInfer (PyPI `flashinfer-python`) JIT-compiles an sm90 MLA kernel ("fa3", wgmma tiles) on first
use with the machine's nvcc. It is never required: `flashinfer_mla_available()` says whether it
imports and runs here, and the attention backend falls back to our Triton kernel otherwise.

One plan per batch: FlashInfer partitions the work on the host from the sequence lengths, so
`plan_decode` runs once per `ForwardBatch` and every layer reuses it (`MLAPlan.run`). The wrapper it
plans is lent by a `WrapperPool` where the caller keeps one: building one allocates an 8 MB device
buffer and an 8 MB pinned host buffer (`cudaHostAlloc`), host work that has no place in each eager
step; a wrapper goes back to the pool when the plan that holds it is dropped with its batch. FlashInfer
takes the pages as CSR with exactly ceil(length / page_size) pages per sequence; they are built on
the host from the batch's page lists (no device sync), or compacted from the padded device table
when a batch has no host lists.

CUDA graphs: a captured graph replays the kernel launches with the addresses they were captured
with, while the plan is host work on the batch's lengths. `GraphMLAPlan` is the plan of one captured
batch size: its wrapper is built with `use_cuda_graph=True` over page-index buffers reserved for the
largest batch the graph can hold, so `replan` (host work, before each replay) rewrites the
metadata in place and the replayed launches read the new lengths and pages.

The torch backend (`model/attention/torch_backend.py`) is the oracle: tests/model/kernels/test_flashinfer_mla.py.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.kernels.mla_decode_route import FLASHINFER_WIDTHS

# FlashInfer's recommended float workspace (split-K partials); one per device, shared by all plans.
_WORKSPACE_BYTES = 128 << 20
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_WIDTHS = FLASHINFER_WIDTHS  # the latent and rope widths its kernels are compiled for


@functools.lru_cache(maxsize=None)
def flashinfer_mla_available() -> bool:
    """Whether FlashInfer's MLA wrapper imports, a Hopper (sm90) GPU is present and nvcc is there
    to JIT-compile its kernel on first use (without it the first plan would fail mid-serving)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    if flashinfer_mla_blocker() is not None:
        return False
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401
    except Exception:  # an import error, or a broken install (missing nvcc headers, ABI)
        return False
    return True


def flashinfer_mla_blocker() -> str | None:
    """Why FlashInfer's MLA decode cannot be chosen here, judged without touching the GPU (`serve`
    decides its backends before any rank exists, and holds no CUDA context); None when it may be:
    the package is installed and nvcc is there to compile its kernel. The GPU itself is judged
    where the kernel runs (`compile_and_run_once`, at a rank's start-up: model/jit_backends.py)."""
    if importlib.util.find_spec("flashinfer") is None:
        return "FlashInfer is not installed (Dockerfile.cuda WITH_FLASHINFER=1 installs it)"
    if not _nvcc_found():
        return "no nvcc (on PATH or in CUDA_HOME/bin) to compile FlashInfer's MLA kernel"
    return None


def compile_and_run_once(device: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Compiles FlashInfer's MLA decode kernel (its JIT, on first use) and runs it once on `device`
    at the smallest real shape (one sequence of one token, 16 heads, DeepSeek's widths, `dtype`).
    The kernel module is the one every decode of those widths and dtype runs (the head count and
    lengths are run-time arguments). Raises, with the reason, where it cannot run here."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"FlashInfer's MLA kernel runs on a CUDA device, not {device!r}")
    if torch.cuda.get_device_capability(dev) != (9, 0):
        major, minor = torch.cuda.get_device_capability(dev)
        raise RuntimeError(f"FlashInfer's MLA kernel here is the Hopper (sm90) one; this GPU is sm{major}{minor}")
    if not _nvcc_found():
        raise RuntimeError("no nvcc (on PATH or in CUDA_HOME/bin) to compile FlashInfer's MLA kernel; "
                           "build the image with the CUDA compiler (Dockerfile.cuda WITH_FLASHINFER=1)")
    rank, rope = SUPPORTED_WIDTHS
    page_size, heads = 64, 16
    kv_cache = torch.zeros(1, page_size, rank + rope, dtype=dtype, device=dev)
    plan = plan_decode(torch.zeros(1, 1, dtype=torch.int32, device=dev), [1], heads, rank, rope, page_size, 1.0,
                       dtype, page_lists=[[0]])
    plan.run(torch.zeros(1, heads, rank, dtype=dtype, device=dev), torch.zeros(1, heads, rope, dtype=dtype, device=dev),
             kv_cache)
    torch.cuda.synchronize(dev)


def _nvcc_found() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return shutil.which("nvcc") is not None or bool(CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))


@functools.lru_cache(maxsize=None)
def _workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


@dataclass
class MLAPlan:
    """A planned FlashInfer MLA call for one batch shape; `run` may be called once per layer."""

    wrapper: object
    num_tokens: int
    num_heads: int
    rank: int
    rope: int

    def run(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """q_latent `[T,H,R]`, q_pe `[T,H,P]`, kv_cache `[pages, page, R+P]` → latent output `[T,H,R]`
        (written into `out` when given: contiguous, q_latent's dtype)."""
        t, h = self.num_tokens, self.num_heads
        if q_latent.shape != (t, h, self.rank) or q_pe.shape != (t, h, self.rope):
            raise ValueError(f"planned for q [{t},{h},{self.rank}] + [{t},{h},{self.rope}], got "
                             f"{tuple(q_latent.shape)} + {tuple(q_pe.shape)}")
        if kv_cache.shape[-1] != self.rank + self.rope or not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache must be contiguous [pages, page, {self.rank + self.rope}], "
                             f"got {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
        # The kernel indexes query rows densely; the MLA layer's q_latent is a transposed bmm output.
        q_nope = q_latent.contiguous()
        q_rope = q_pe.contiguous()
        if out is None:
            out = torch.empty_like(q_nope)
        elif out.shape != q_nope.shape or out.dtype != q_nope.dtype or not out.is_contiguous():
            raise ValueError(f"out must be contiguous {tuple(q_nope.shape)} {q_nope.dtype}, got {tuple(out.shape)}")
        self.wrapper.run(query=(q_nope, q_rope), kv_cache=kv_cache, out=out)
        return out


class WrapperPool:
    """Wrappers lent to plans and taken back when a plan is garbage: each live plan holds its own
    (two-batch overlap keeps two batches' plans alive at once), and a batch's plan is never re-planned
    under it. Planning writes FlashInfer's pinned host buffer, then copies it to the device
    asynchronously: a returned wrapper waits for that copy (an event recorded after its plan) before
    it is planned again, so the host never overwrites bytes still in flight.

        pool = WrapperPool(lambda: BatchMLAPagedAttentionWrapper(workspace, backend="fa3"))
        wrapper = pool.take(); plan(wrapper); mla_plan = MLAPlan(wrapper, ...); pool.lend(mla_plan, wrapper)
    """

    def __init__(self, make: Callable[[], object]) -> None:
        self._make = make
        self._free: list[tuple[object, object]] = []  # (wrapper, the event after its last plan, or None)
        self.built = 0

    def take(self) -> object:
        if self._free:
            wrapper, planned = self._free.pop()
            if planned is not None:
                planned.synchronize()
            return wrapper
        self.built += 1
        return self._make()

    def lend(self, holder: object, wrapper: object) -> None:
        """`wrapper` (from `take`, just planned) comes back once `holder` is garbage."""
        planned = None
        if torch.cuda.is_available():
            planned = torch.cuda.Event()
            planned.record()
        weakref.finalize(holder, self._free.append, (wrapper, planned))


def csr_pages(seq_lens: Sequence[int], page_size: int,
              page_lists: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """FlashInfer's page CSR from host page lists: `kv_indptr` `[B+1]` and `kv_indices`, exactly
    ceil(length / page_size) pages per sequence (FlashInfer 0.7 refuses padded rows).

    Example, page_size 4: lengths (5, 1), lists ([7, 2, 9], [3]) -> ([0, 2, 3], [7, 2, 3]).
    """
    if len(page_lists) != len(seq_lens):
        raise ValueError(f"{len(page_lists)} page lists for {len(seq_lens)} sequences")
    indptr, indices = [0], []
    for length, pages in zip(seq_lens, page_lists):
        count = -(-length // page_size)
        if length < 1 or len(pages) < count:
            raise ValueError(f"a sequence of {length} tokens needs {count} pages of {page_size}, got {len(pages)}")
        indices.extend(pages[:count])
        indptr.append(indptr[-1] + count)
    return indptr, indices


def _check_shape(num_heads: int, rank: int, rope: int, dtype: torch.dtype) -> None:
    if (rank, rope) != SUPPORTED_WIDTHS:
        raise ValueError(f"FlashInfer MLA runs latent/rope widths {SUPPORTED_WIDTHS}, not {(rank, rope)}")
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"FlashInfer MLA runs bf16/fp16, not {dtype}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")


def _plan(wrapper, seq_lens: Sequence[int], kv_indptr: list[int], kv_indices: torch.Tensor, num_heads: int,
          rank: int, rope: int, page_size: int, scale: float, dtype: torch.dtype) -> None:
    """One `wrapper.plan` over host CSR metadata: one query per sequence, packed latent cache."""
    from flashinfer.mla import MLAPlanMetadata

    # The wrapper copies these to the device (`.to(device, non_blocking=True)`, or `copy_` into a
    # graph's buffers): from page-locked memory, so the copies are asynchronous, not staged through
    # the driver's pageable buffers behind the forward queued before them.
    metadata = MLAPlanMetadata.csr(qo_indptr=_pinned(torch.arange(len(seq_lens) + 1, dtype=torch.int32)),
                                   kv_indptr=_pinned(torch.tensor(kv_indptr, dtype=torch.int32)),
                                   kv_indices=_pinned(kv_indices),
                                   kv_len_arr=_pinned(torch.tensor(list(seq_lens), dtype=torch.int32)))
    wrapper.plan(metadata=metadata, num_heads=num_heads, head_dim_ckv=rank, head_dim_kpe=rope,
                 page_size=page_size, causal=False, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype,
                 query_layout="split", kv_cache_layout="packed")


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """`host` in page-locked memory (torch's caching host allocator keeps it until its copies ran);
    a device tensor as it is."""
    return host if host.is_cuda else host.pin_memory()


def plan_decode(page_table: torch.Tensor, seq_lens: Sequence[int], num_heads: int, rank: int, rope: int,
                page_size: int, scale: float, dtype: torch.dtype, backend: str = "fa3",
                page_lists: Sequence[Sequence[int]] = (), pool: WrapperPool | None = None) -> MLAPlan:
    """Plan one query per sequence over `page_table` `[B, W]` (device) with host `seq_lens`;
    `page_lists` (host, per sequence, at least the pages its length needs), when given, spares the
    device-to-host read of the table. `pool` (its wrappers made with `backend`) lends the wrapper;
    without one a new wrapper is built."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    _check_shape(num_heads, rank, rope, dtype)
    batch, width = page_table.shape
    if batch != len(seq_lens) or batch == 0:
        raise ValueError(f"page table has {batch} rows for {len(seq_lens)} sequences")
    if max(seq_lens) > width * page_size or min(seq_lens) < 1:
        raise ValueError(f"lengths {min(seq_lens)}..{max(seq_lens)} do not fit {width} pages of {page_size}")
    if page_lists:
        if len(page_lists) != batch:
            raise ValueError("page_lists must hold every page of each sequence's length")
        try:
            kv_indptr, indices = csr_pages(seq_lens, page_size, page_lists)
        except ValueError:
            raise ValueError("page_lists must hold every page of each sequence's length") from None
        kv_indices = torch.tensor(indices, dtype=torch.int32)
    else:
        counts = [-(-n // page_size) for n in seq_lens]
        kv_indptr = [0]
        for c in counts:
            kv_indptr.append(kv_indptr[-1] + c)
        used = torch.arange(width, device=page_table.device) \
            < upload(torch.tensor(counts, dtype=torch.long), page_table.device)[:, None]
        kv_indices = page_table[used].to(torch.int32)  # row-major: each sequence's pages in order
    wrapper = pool.take() if pool is not None else \
        BatchMLAPagedAttentionWrapper(_workspace(page_table.device), backend=backend)
    plan = MLAPlan(wrapper, batch, num_heads, rank, rope)
    try:
        _plan(wrapper, seq_lens, kv_indptr, kv_indices, num_heads, rank, rope, page_size, scale, dtype)
    finally:  # a failed plan gives its wrapper back too
        if pool is not None:
            pool.lend(plan, wrapper)
    return plan


def eager_wrapper_pool(device: torch.device, backend: str = "fa3") -> WrapperPool:
    """A pool of `backend` wrappers over the device's shared workspace, for `plan_decode`."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    return WrapperPool(lambda: BatchMLAPagedAttentionWrapper(_workspace(torch.device(device)), backend=backend))


class GraphMLAPlan:
    """The FlashInfer plan of one captured CUDA graph: `batch` sequences (padding rows included) of
    at most `max_pages` pages in all. `replan` before each replay, then the graph's `plan.run`
    launches read the new metadata from the same reserved buffers."""

    def __init__(self, batch: int, max_pages: int, num_heads: int, rank: int, rope: int, page_size: int,
                 scale: float, dtype: torch.dtype, device: torch.device, backend: str = "fa3") -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        _check_shape(num_heads, rank, rope, dtype)
        if batch < 1 or max_pages < batch:
            raise ValueError(f"a graph of {batch} sequences needs at least one page each, got {max_pages}")
        self.batch, self.max_pages, self.page_size = batch, max_pages, page_size
        self._shape = (num_heads, rank, rope, page_size, scale, dtype)
        i32 = dict(dtype=torch.int32, device=device)
        self._wrapper = BatchMLAPagedAttentionWrapper(
            _workspace(torch.device(device)), use_cuda_graph=True, qo_indptr=torch.zeros(batch + 1, **i32),
            kv_indptr=torch.zeros(batch + 1, **i32), kv_indices=torch.zeros(max_pages, **i32),
            kv_len_arr=torch.zeros(batch, **i32), backend=backend)
        self.plan = MLAPlan(self._wrapper, batch, num_heads, rank, rope)

    def replan(self, seq_lens: Sequence[int], page_lists: Sequence[Sequence[int]]) -> None:
        """Host work of one step: the lengths and pages (host) of all `batch` rows."""
        if len(seq_lens) != self.batch:
            raise ValueError(f"the graph holds {self.batch} sequences, got {len(seq_lens)} lengths")
        kv_indptr, indices = csr_pages(seq_lens, self.page_size, page_lists)
        if len(indices) > self.max_pages:
            raise ValueError(f"{len(indices)} pages exceed the {self.max_pages} reserved at capture")
        num_heads, rank, rope, page_size, scale, dtype = self._shape
        _plan(self._wrapper, seq_lens, kv_indptr, torch.tensor(indices, dtype=torch.int32), num_heads, rank, rope,
              page_size, scale, dtype)
