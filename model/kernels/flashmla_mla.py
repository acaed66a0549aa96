"""FlashMLA's sm90 dense MLA decode (optional), behind a thin wrapper that checks its inputs.

FlashMLA (deepseek-ai/FlashMLA) is built from source with nvcc for Hopper (bench/flashmla_build.sh,
at a pinned commit: its newest releases dropped Hopper's dense decode). It is never required:
`flash_mla_module()` imports the installed package, or a built one carried in the folder that
DEEPSEEK_PD_FLASHMLA_DIR names (deepseek_pd/env.py); `flashmla_available()` says whether it
imports here on a Hopper GPU and passes its start-up check (`check_against_reference`); the
"flashmla" attention backend (model/attention/flashmla_backend.py) is built only then.

Its kernel reads our paged latent cache as it is: pages of 64 tokens of 512 + 64 values (one KV
head), our int32 page table (rows padded with their own last page: it reads only the pages a
row's length needs) and int32 lengths on the device. The query is the latent and rope parts joined,
`[B, 1, H, 576]`: one copy of the query per layer (2.4 MB at 128 heads, batch 16).

One scheduling metadata per batch: FlashMLA splits each sequence's keys over the SMs from the
lengths, with a small device kernel (`get_mla_metadata` returns an empty holder; the first call
fills it). `MLADecodeCall` keeps one holder per `ForwardBatch`, so the first layer computes it and
every later layer reuses it.

CUDA graphs: nothing is planned on the host. In a captured forward the first layer's call records
the metadata kernel, reading the lengths from the graph's static buffer, and later layers read its
output; each replay recomputes it from the step's lengths. The batch object is fresh at capture
(model/graph_inputs.py), so no holder filled by a warm-up run is carried into a graph.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from pathlib import Path

import torch

from deepseek_pd import env
from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.kernels.mla_decode_route import FLASHMLA_PAGE_SIZE, FLASHMLA_WIDTHS
from deepseek_pd.model.nvml import compute_capability

log = logging.getLogger(__name__)

HOPPER = (9, 0)  # the one compute capability our FlashMLA build (its sm90 kernels) runs on
SUPPORTED_DTYPES = (torch.bfloat16,)  # scripts/flashmla_setup.py builds the bf16 kernel only
_BUILD_HINT = "bench/flashmla_build.sh builds it; DEEPSEEK_PD_FLASHMLA_DIR names a folder holding the built package"


def _carried_dir() -> Path | None:
    """The folder DEEPSEEK_PD_FLASHMLA_DIR names when it holds a `flash_mla` package, else None."""
    folder = env.flashmla_dir()
    if folder is None or not (Path(folder) / "flash_mla" / "__init__.py").is_file():
        return None
    return Path(folder)


def flashmla_blocker(device: str | None = None) -> str | None:
    """Why FlashMLA cannot be chosen here, judged without importing it or making a CUDA context
    (`serve` decides its backends and page size before any rank exists); None when it may be:
    `flash_mla` is installed, or carried in DEEPSEEK_PD_FLASHMLA_DIR, and the CUDA `device` (when
    given) is a Hopper GPU or NVML cannot tell. The build itself is judged by `flashmla_available`."""
    if importlib.util.find_spec("flash_mla") is not None or _carried_dir() is not None:
        return None if device is None else _gpu_blocker(device)
    folder = env.flashmla_dir()
    if folder is not None:
        return f"DEEPSEEK_PD_FLASHMLA_DIR={folder} holds no flash_mla package ({_BUILD_HINT})"
    return f"FlashMLA (flash_mla) is not installed ({_BUILD_HINT})"


def _gpu_blocker(device: str) -> str | None:
    """Why `device` cannot run FlashMLA's sm90 kernels, by NVML's compute capability; None: it is a
    Hopper GPU, or NVML cannot tell (the start-up check, model/jit_backends.py, then decides)."""
    capability = compute_capability(device)
    if capability is None or capability == HOPPER:
        return None
    return f"FlashMLA's dense decode is built for Hopper (sm90), and {device} is sm{capability[0]}{capability[1]}"


def flash_mla_module():
    """The `flash_mla` package: the installed one, else the built one in DEEPSEEK_PD_FLASHMLA_DIR.
    Raises ImportError saying why neither imports."""
    try:
        import flash_mla
    except ImportError as exc:
        carried = _carried_dir()
        if carried is None:
            raise ImportError(f"{flashmla_blocker() or exc}") from exc
        # A carried build is a plain package folder (flash_mla/ with its compiled cuda*.so): on the
        # import path it imports as an installed one would, with no install step on the machine.
        sys.path.append(str(carried))
        import flash_mla
    return flash_mla


def _check_sm90(device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"FlashMLA's dense decode runs on a CUDA device, not {device}")
    if torch.cuda.get_device_capability(device) != HOPPER:
        major, minor = torch.cuda.get_device_capability(device)
        raise RuntimeError(f"FlashMLA's dense decode here is the Hopper (sm90a) one; this GPU is sm{major}{minor}")


class MLADecodeCall:
    """FlashMLA's decode of one batch, for every layer: `block_table` `[B, W]` and `seq_lens` `[B]`
    int32 on the device (what `triton_backend.decode_metadata` builds once per batch), `num_heads`
    query heads, `scale` the softmax scale. The scheduling metadata is filled by the first `run`
    and reused by the rest (module docstring).

        call = MLADecodeCall(table, lengths, 128, scale)
        out = call.run(q_latent, q_pe, kv_cache)   # per layer: [B, H, 512]
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, scale: float) -> None:
        if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise ValueError(f"FlashMLA takes an int32 page table and lengths, got {block_table.dtype}, "
                             f"{seq_lens.dtype}")
        if block_table.dim() != 2 or seq_lens.shape != (block_table.shape[0],) or block_table.shape[0] < 1:
            raise ValueError(f"page table [B, W] and lengths [B], got {tuple(block_table.shape)} and "
                             f"{tuple(seq_lens.shape)}")
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        self._flash_mla = flash_mla_module()
        self.block_table, self.seq_lens = block_table.contiguous(), seq_lens.contiguous()
        self.num_heads, self.scale = num_heads, scale
        self._metadata = self._flash_mla.get_mla_metadata()[0]

    def run(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """q_latent `[B,H,R]`, q_pe `[B,H,P]` (any strides), kv_cache `[pages, 64, R+P]` contiguous
        → the latent output `[B,H,R]` in q_latent's dtype."""
        rank, rope = FLASHMLA_WIDTHS
        b, h = self.block_table.shape[0], self.num_heads
        if q_latent.shape != (b, h, rank) or q_pe.shape != (b, h, rope):
            raise ValueError(f"FlashMLA decode of {b} sequences x {h} heads takes q [{b},{h},{rank}] + "
                             f"[{b},{h},{rope}], got {tuple(q_latent.shape)} + {tuple(q_pe.shape)}")
        if q_latent.dtype not in SUPPORTED_DTYPES or q_pe.dtype != q_latent.dtype or kv_cache.dtype != q_latent.dtype:
            raise ValueError(f"FlashMLA runs {SUPPORTED_DTYPES} for q and the cache alike, got "
                             f"{q_latent.dtype}, {q_pe.dtype}, {kv_cache.dtype}")
        if kv_cache.dim() != 3 or kv_cache.shape[1:] != (FLASHMLA_PAGE_SIZE, rank + rope) \
                or not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache must be contiguous [pages, {FLASHMLA_PAGE_SIZE}, {rank + rope}], got "
                             f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
        query = torch.cat([q_latent, q_pe], dim=-1).unsqueeze(1)  # [B, 1, H, R+P]
        out, _ = self._flash_mla.flash_mla_with_kvcache(
            query, kv_cache.unsqueeze(2), self.block_table, self.seq_lens, rank, self._metadata,
            softmax_scale=self.scale, causal=False)
        return out.squeeze(1)


def _dense_reference(q: torch.Tensor, keys: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """One sequence's absorbed MLA in fp32: q `[H, R+P]`, keys `[L, R+P]` (their first R values
    are also the values) → `[H, R]`."""
    scores = (q.float() @ keys.float().T) * scale
    return torch.softmax(scores, dim=-1) @ keys[:, :rank].float()


def check_against_reference(device: str = "cuda", tolerance: float = 2e-2) -> None:
    """Runs FlashMLA's decode once on `device` at a tiny case (two sequences, 16 heads, one of
    them longer than a page, the other's pages in reverse order) and compares it with a dense
    fp32 computation. Raises, with the reason, where it cannot run here or disagrees."""
    dev = torch.device(device)
    _check_sm90(dev)
    rank, rope = FLASHMLA_WIDTHS
    heads, lengths, page = 16, (FLASHMLA_PAGE_SIZE + 7, 3), FLASHMLA_PAGE_SIZE
    gen = torch.Generator(device="cpu").manual_seed(0)
    cache = torch.randn(4, page, rank + rope, generator=gen).to(dev, torch.bfloat16)
    table = upload(torch.tensor([[2, 1], [3, 3]], dtype=torch.int32), dev)
    q = torch.randn(len(lengths), heads, rank + rope, generator=gen).to(dev, torch.bfloat16)
    scale = 192 ** -0.5
    out = MLADecodeCall(table, upload(torch.tensor(lengths, dtype=torch.int32), dev), heads, scale).run(
        q[..., :rank], q[..., rank:], cache)
    for i, n in enumerate(lengths):
        keys = cache[table[i].long()].reshape(-1, rank + rope)[:n]
        want = _dense_reference(q[i], keys, rank, scale)
        err = float((out[i].float() - want).norm() / want.norm())
        if not err < tolerance:  # also catches NaN
            raise RuntimeError(f"FlashMLA's decode disagrees with the reference: relative error {err:.3g} "
                               f"(sequence of {n} tokens)")


@functools.lru_cache(maxsize=None)
def flashmla_available() -> bool:
    """Whether FlashMLA imports here, the GPU is Hopper and its start-up check passes (the reason
    it does not is logged)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != HOPPER:
        return False
    if (blocker := flashmla_blocker()) is not None:
        log.debug("FlashMLA: %s", blocker)
        return False
    try:
        check_against_reference("cuda")
    except Exception as exc:  # an import error (ABI, a build for another torch), a launch error, a wrong result
        log.warning("FlashMLA's decode cannot run here: %s: %s", type(exc).__name__, exc)
        return False
    return True
