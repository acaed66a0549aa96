"""Reading HF DeepSeek checkpoints: config.json plus safetensors, single-file or sharded.

`iter_checkpoint_tensors` streams `(hf_name, tensor)` pairs in file order, which is what
`DeepseekForCausalLM.load_weights` consumes. On the way it
- dequantises FP8 block-scaled weights (`X.weight` fp8 + `X.weight_scale_inv`) on CPU,
- skips the MTP / nextn layers (`model.layers.{i}` with i >= num_hidden_layers) unless asked
  (`BuildOptions.mtp`: then a checkpoint without its MTP layer is a UserError at start-up),
- turns every way a checkpoint can be broken into a `UserError` that names the file or tensor.

Example: a 163-shard FP8 DeepSeek-V3 directory yields every weight of layers 0-60 dequantised (its
`weight_scale_inv` tensors consumed) and never the tensors of layer 61, the MTP module.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from deepseek_pd.errors import CheckpointError, UserError
from deepseek_pd.model.checkpoint.model_dir import read_json
from deepseek_pd.model.speculative.mtp_names import MTP_MARKER, mtp_hf_prefix
from deepseek_pd.model.quant.fp8 import (FP8_DTYPES, SCALE_SUFFIX, Fp8BlockQuantConfig, check_scale_shape,
                                   dequantize_block_fp8)

if TYPE_CHECKING:
    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.deepseek import DeepseekForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def read_hf_config(path: str | Path) -> dict:
    """The checkpoint's config.json as a dict (read as every checkpoint file is, `model_dir.read_json`),
    or a UserError saying what is wrong with it."""
    directory = Path(path)
    if not directory.is_dir():
        raise UserError(f"model directory {str(directory)!r} does not exist")
    return read_json(directory, "config.json")


@dataclass(frozen=True)
class CheckpointFiles:
    """Which safetensors file holds which tensor."""

    directory: Path
    tensor_to_file: dict[str, Path]

    @property
    def files(self) -> list[Path]:
        return sorted(set(self.tensor_to_file.values()))

    @classmethod
    def discover(cls, path: str | Path) -> "CheckpointFiles":
        directory = Path(path)
        if not directory.is_dir():
            raise UserError(f"model directory {str(directory)!r} does not exist")
        index_file = directory / INDEX_FILE
        if index_file.is_file():
            return cls._from_index(directory, index_file)
        candidates = sorted(directory.glob("*.safetensors"))
        if not candidates:
            raise UserError(f"{directory}: no {SINGLE_FILE}, no {INDEX_FILE} and no *.safetensors files")
        if len(candidates) > 1 and (directory / SINGLE_FILE) in candidates:
            candidates = [directory / SINGLE_FILE]
        mapping: dict[str, Path] = {}
        for file in candidates:
            for name in _tensor_names(file):
                if name in mapping:
                    raise UserError(f"tensor {name!r} is in both {mapping[name].name} and {file.name}")
                mapping[name] = file
        return cls(directory, mapping)

    @classmethod
    def _from_index(cls, directory: Path, index_file: Path) -> "CheckpointFiles":
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{index_file}: malformed index ({exc})") from None
        files = {name: directory / str(file) for name, file in weight_map.items()}
        missing_files = sorted({f.name for f in files.values() if not f.is_file()})
        if missing_files:
            raise UserError(f"{index_file.name} names shard files that do not exist: {', '.join(missing_files)}")
        missing_tensors = []
        for file in sorted(set(files.values())):
            present = set(_tensor_names(file))
            missing_tensors += [n for n, f in files.items() if f == file and n not in present]
        if missing_tensors:
            raise CheckpointError(missing_tensors, [], where=f"{index_file.name} lists tensors absent from their shard")
        return cls(directory, files)


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{file}: cannot read safetensors file (corrupt or truncated?): {exc}") from None


class _ShardReader:
    """Keeps each shard open once; safe_open memory-maps, so holding handles costs no RAM."""

    def __init__(self) -> None:
        self._handles: dict[Path, object] = {}

    def get(self, file: Path, name: str) -> torch.Tensor:
        try:
            if file not in self._handles:
                self._handles[file] = safe_open(str(file), framework="pt").__enter__()
            return self._handles[file].get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"{file}: cannot read tensor {name!r} (corrupt file?): {exc}") from None

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _layer_index(name: str) -> int | None:
    match = _LAYER_RE.match(name)
    return int(match.group(1)) if match else None


def iter_checkpoint_tensors(path: str | Path, config: object | None = None, progress: bool = True,
                            fp8_dtype: torch.dtype = torch.float32,
                            keep_mtp_layers: bool = False, keep_fp8: bool = False
                            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `(hf_name, tensor)` for every tensor the model needs, FP8 weights dequantised to `fp8_dtype`.

    `config` is anything with `num_hidden_layers` (the frozen ModelConfig); None reads config.json.
    FP8 weights come out in fp32 by default, so the model's copy into its own dtype rounds once.
    Scale tensors are consumed with their weight and never yielded, unless `keep_fp8` (for models
    with FP8 kernels): then each FP8 weight is yielded as stored, followed by its `..._scale_inv`.
    The progress bar goes to stderr and only when it is a terminal.
    """
    hf_config = read_hf_config(path)
    num_layers = getattr(config, "num_hidden_layers", None) or hf_config.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise UserError(f"{Path(path) / 'config.json'}: num_hidden_layers={num_layers!r} must be a positive integer")
    quant = Fp8BlockQuantConfig.from_hf(hf_config.get("quantization_config"))
    files = CheckpointFiles.discover(path)
    names = [n for n in files.tensor_to_file
             if keep_mtp_layers or (_layer_index(n) is None or _layer_index(n) < num_layers)]
    scale_names = {n for n in names if n.endswith(SCALE_SUFFIX)}
    orphans = sorted(s for s in scale_names if s[: -len(SCALE_SUFFIX)] not in files.tensor_to_file)
    if orphans:
        raise CheckpointError([], orphans, where=f"{files.directory}: scales without a weight")
    weights = [n for n in names if n not in scale_names]

    reader = _ShardReader()
    bar = tqdm(total=len(weights), desc=f"Loading {files.directory.name}", unit="tensor", file=sys.stderr,
               disable=not progress or not sys.stderr.isatty(), leave=False)
    try:
        # File order keeps reads sequential within a shard.
        for name in sorted(weights, key=lambda n: (files.tensor_to_file[n], n)):
            yield from _weight_items(name, reader.get(files.tensor_to_file[name], name), files, reader, quant,
                                     fp8_dtype, keep_fp8)
            bar.update(1)
    finally:
        bar.close()
        reader.close()


def _weight_items(name: str, tensor: torch.Tensor, files: CheckpointFiles, reader: _ShardReader,
                  quant: Fp8BlockQuantConfig | None, fp8_dtype: torch.dtype,
                  keep_fp8: bool) -> list[tuple[str, torch.Tensor]]:
    """What one stored weight becomes: itself, its dequantised value, or (FP8 weight, its scale)."""
    scale_name = name + SCALE_SUFFIX
    if tensor.dtype not in FP8_DTYPES:
        if scale_name in files.tensor_to_file:
            raise UserError(f"{name} has a {SCALE_SUFFIX} but is {tensor.dtype}, not FP8")
        return [(name, tensor)]
    if scale_name not in files.tensor_to_file:
        raise CheckpointError([scale_name], [], where=f"FP8 weight {name} has no scale")
    if quant is None:
        raise UserError(f"{name} is FP8 but config.json has no quantization_config")
    scale = reader.get(files.tensor_to_file[scale_name], scale_name)
    if keep_fp8:
        check_scale_shape(tensor, scale, quant, name)
        return [(name, tensor), (scale_name, scale)]
    return [(name, dequantize_block_fp8(tensor, scale, quant, dtype=fp8_dtype, name=name))]


def load_model(path: str | Path, options: "BuildOptions | None" = None,
               progress: bool = True, config: "ModelConfig | None" = None) -> "DeepseekForCausalLM":
    """Builds `DeepseekForCausalLM` from a checkpoint directory (or "tiny") and loads its weights.

    The one model-loading rule: `ModelRunner` loads through it too. `options` (default: fp32 on
    CPU) picks dtype, device and backends; FP8 weights stay FP8 when `options.fp8_backend` runs
    them, else they are dequantised to `options.dtype`. `config` is `path`'s config.json already
    parsed (`ModelConfig.from_hf`) by a caller that needed it first; None parses it here.
    """
    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.deepseek import DeepseekForCausalLM
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir

    directory = resolve_model_dir(path)  # "tiny" -> the generated, cached checkpoint
    config = ModelConfig.from_hf(directory) if config is None else config
    options = options or BuildOptions()
    model = DeepseekForCausalLM(config, options)  # refuses an MTP layer the config does not have
    marker = f"{mtp_hf_prefix(config)}{MTP_MARKER}"
    if options.mtp and marker not in CheckpointFiles.discover(directory).tensor_to_file:
        raise UserError(f"{directory}: speculative decoding needs the checkpoint's MTP layer, but it has no "
                        f"{marker} (a checkpoint without its MTP layer: run without --speculative-num-steps)")
    model.load_weights(iter_checkpoint_tensors(directory, config, progress=progress, fp8_dtype=options.dtype,
                                               keep_fp8=options.fp8_backend is not None,
                                               keep_mtp_layers=options.mtp))
    return model.eval()
