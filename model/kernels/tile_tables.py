"""Measured launch tiles (data only; `tile_table.py` reads it). Replace this file with the
`tile_tables.py` that `bench/fp8_prefill_gpu.py` writes under its --out folder after a sweep on the
GPU: one table per kernel, per GPU name and shape, rows ranges → tile fields.

Empty: every kernel uses its own `default_tile` rule.
"""
TABLES: dict[str, dict[str, dict[str, list]]] = {}
