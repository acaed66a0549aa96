"""Helpers that write HF-style checkpoints for loader and engine tests (no model code involved)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deepseek_pd.model.checkpoint.tiny import STAMP_FILE
from deepseek_pd.model.quant.fp8 import (Fp8BlockQuantConfig, dequantize_block_fp8, hf_quantization_config,
                                   quantize_checkpoint)


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], config: dict,
                     num_shards: int = 1, seed: int = 0) -> Path:
    """Writes config.json and either model.safetensors or `num_shards` shards plus the index,
    tensors assigned to shards at random (so a layer's weights are spread over files)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if num_shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    gen = torch.Generator().manual_seed(seed)
    names = sorted(tensors)
    assignment = torch.randint(0, num_shards, (len(names),), generator=gen).tolist()
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n, s in zip(names, assignment) if s == shard}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def fp8_twins(tensors: dict[str, torch.Tensor], block: Fp8BlockQuantConfig
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(fp8 checkpoint tensors with scales, the same weights dequantised in fp32)."""
    quantised = quantize_checkpoint(tensors, block)
    twin = {}
    for name, tensor in quantised.items():
        if name.endswith("_scale_inv"):
            continue
        scale = quantised.get(name + "_scale_inv")
        twin[name] = tensor if scale is None else dequantize_block_fp8(tensor, scale, block, dtype=torch.float32)
    return quantised, twin


def make_fp8_tiny(src: Path, dst: Path, block: tuple[int, int]) -> tuple[Path, Path]:
    """From a tiny checkpoint, writes an FP8 copy at `dst` and its dequantised fp32 twin at `dst`-twin."""
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    quantised, twin = fp8_twins(tensors, Fp8BlockQuantConfig(*block))
    fp8_config = {**config, "quantization_config": hf_quantization_config(Fp8BlockQuantConfig(*block))}
    twin_dir = dst.parent / (dst.name + "-twin")
    for directory, weights, cfg in ((dst, quantised, fp8_config), (twin_dir, twin, config)):
        write_checkpoint(directory, weights, cfg)
        for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(src / extra, directory / extra)
    return dst, twin_dir


def make_near_ties(directory: Path, closeness: float, seed: int) -> Path:
    """Rewrites the checkpoint's lm_head in place as c + closeness * W (c: one random row shared
    by every token) and drops the tiny generator's stamp (these are no longer its weights).

    Every logit gains the same c . h, so greedy tokens are the same as before in exact
    arithmetic, and float32 keeps them; but the rows now differ by `closeness` of their size,
    below bfloat16's resolution (2^-8) at 0.01, so a bfloat16 run picks other tokens: what a
    precision change does to a real model whose top logits are close. The engine under test
    is the oracle (run it in both dtypes) for which tokens differ."""
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    weight = tensors["lm_head.weight"]
    shared = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(seed), dtype=weight.dtype)
    tensors["lm_head.weight"] = (shared * weight.std() + closeness * weight).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
    (directory / STAMP_FILE).unlink(missing_ok=True)
    return directory
