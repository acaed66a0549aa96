"""`bench/fp8_prefill_gpu.py --tiny`: the FP8 prefill bench's whole path on the CPU (Triton's
interpreter), so the one GPU call that times every variant does not fail on the script itself."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdtest.triton_env import needs_triton  # the interpreter must run here

REPO = Path(__file__).resolve().parents[2]


@needs_triton
@pytest.mark.timeout(300)
def test_tiny_run_checks_and_times_every_variant(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "fp8_prefill_gpu.py"), "--tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "fp8_prefill.json").read_text())
    assert all(row[key]["bytes_equal"] for row in results["quant"]["rows"] for key in row if key.startswith("groups"))
    for row in results["linear"]["rows"]:
        for variant in ("bf16", "shipped", "triton_default", *(f"tiles/{t}" for t in row["tiles"])):
            v = row["tiles"][variant[6:]] if variant.startswith("tiles/") else row[variant]
            # bf16 is the twin itself; the FP8 variants are the exact FP8 arithmetic (fp32 on the CPU).
            got = v["twin"]["rel"] if variant == "bf16" else v["err"]["rel"]
            assert v["ms"] > 0 and got < 1e-4, (variant, v)
    for row in results["moe"]["rows"]:
        for variant in ("fp8_triton", *row["fp8_tiles"]):
            v = row[variant] if variant == "fp8_triton" else row["fp8_tiles"][variant]
            assert v["ms"] > 0 and v["err"]["rel"] < 1e-4, (variant, v)
        # The twin differs by the activations' e4m3 rounding only: a few percent, not O(1).
        assert row["fp8_triton"]["twin"]["rel"] < 0.1
    # The fusions against what they replace: the same bytes, and both timed.
    assert results["norm_quant"]["rows"] and results["qk_split"]["rows"]
    for row in results["norm_quant"]["rows"]:
        assert row["bytes_equal"] and row["fused_ms"] > 0 and row["unfused_ms"] > 0, row
    for row in results["qk_split"]["rows"]:
        assert row["equal"] and row["split_ms"] > 0 and row["concat_then_kernel_ms"] > 0, row
    # The post-attention and TP norm fusions (bench/norm_route_parts.py): the same outputs, both timed;
    # the packed rows the TP all-gather moves are fewer bytes than the model-dtype rows.
    assert results["post_norm_quant"]["rows"] and results["tp_norm_quant"]["rows"]
    for row in results["post_norm_quant"]["rows"]:
        assert row["equal"] and row["fused_ms"] > 0 and row["unfused_ms"] > 0, row
    for row in results["tp_norm_quant"]["rows"]:
        assert row["equal"] and row["packed_row_bytes"] < row["model_dtype_row_bytes"] and row["into_packed_ms"] > 0
    # MLA decode's route: Triton timed and checked against torch; FlashInfer's absence said, not hidden.
    for row in results["mla_route"]["rows"]:
        assert row["triton_err"]["rel"] < 1e-5 and row["triton_ms"] > 0 and row["route"] in ("triton", "flashinfer")
        assert row["flashinfer"] == "ran" or "flashinfer_ms" not in row
    assert results["mla_route"]["rows"]
    # The sweeps as launch tiles: a tile_tables.py the kernels accept, every tile one they can build.
    from deepseek_pd.model.kernels.fp8_gemm import Fp8GemmTile
    from deepseek_pd.model.kernels.fused_moe import MoETile
    from deepseek_pd.model.kernels.tile_table import check

    namespace: dict = {}
    exec((tmp_path / "tile_tables.py").read_text(), namespace)
    tables = namespace["TABLES"]
    check(tables)
    assert set(tables) == {"fp8_gemm", "fused_moe"}
    for kernel, make in (("fp8_gemm", Fp8GemmTile), ("fused_moe", MoETile)):
        for shapes in tables[kernel].values():
            for entries in shapes.values():
                assert entries[-1][1] is None and all(make(**tile) for _, _, tile in entries)
