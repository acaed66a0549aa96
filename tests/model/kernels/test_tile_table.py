"""Measured launch tiles (`model/kernels/tile_table.py`): the rows ranges built from a sweep, the
lookup a kernel makes, and the shipped `tile_tables.TABLES` (each entry well formed, each tile one
its kernel can build)."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.model.kernels.tile_table import check, lookup, ranges
from deepseek_pd.model.kernels.tile_tables import TABLES


def test_ranges_give_each_row_count_the_tile_of_the_next_measured_one():
    counts = sorted(random.sample(range(1, 10_000), random.randint(1, 6)))
    best = {rows: {"id": rows} for rows in counts}
    entries = ranges(best)
    check({"k": {"gpu": {"s": entries}}})
    for rows in range(1, 12_000, 7):
        hits = [tile for lo, hi, tile in entries if lo <= rows and (hi is None or rows <= hi)]
        if rows < counts[0]:
            assert hits == []  # below the sweep: the kernel's own rule
        else:
            want = next((c for c in counts if c >= rows), counts[-1])
            assert hits == [{"id": want}], rows


def test_lookup_off_cuda_and_for_unknown_shapes_is_none():
    tables = {"fp8_gemm": {"any": {"64x64": [[1, None, {"block_m": 16}]]}}}
    assert lookup("fp8_gemm", torch.device("cpu"), "64x64", 5, tables) is None
    assert lookup("other", torch.device("cpu"), "64x64", 5, tables) is None


def test_check_refuses_malformed_entries():
    for bad in ([1, 2], [1, "2", {}], ["1", None, {}], [1, None, []]):
        with pytest.raises(ValueError, match="is not"):
            check({"fp8_gemm": {"gpu": {"1x1": [bad]}}})


def test_shipped_tables_are_well_formed_and_buildable():
    from deepseek_pd.model.kernels.fp8_gemm import Fp8GemmTile
    from deepseek_pd.model.kernels.fused_moe import MoETile

    check(TABLES)
    assert set(TABLES) <= {"fp8_gemm", "fused_moe"}
    for kernel, make in (("fp8_gemm", Fp8GemmTile), ("fused_moe", MoETile)):
        for shapes in TABLES.get(kernel, {}).values():
            for entries in shapes.values():
                for _, _, tile in entries:
                    make(**tile)
