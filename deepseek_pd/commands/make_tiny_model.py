"""`deepseek-pd make-tiny-model DIR`: write the deterministic tiny HF checkpoint (ARCHITECTURE §4)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-tiny-model", help="write a tiny random DeepSeek checkpoint in HF format",
        description="Write a tiny, deterministic DeepSeek-V3 (or V2) checkpoint with random weights: "
                    "config.json, model.safetensors, tokenizer.json with a chat template. It loads in "
                    "HF transformers and in every deepseek-pd command.")
    parser.add_argument("directory", help="where to write it (created if missing)")
    parser.add_argument("--arch", choices=["v3", "v2"], default="v3", help="model family (default v3)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed; same seed, same bytes (default 0)")
    parser.add_argument("--fp8", action="store_true",
                        help="store linear weights as FP8 with 128x128 block scales, as DeepSeek-V3 ships")
    parser.add_argument("--mtp-layers", type=int, choices=[0, 1], default=0,
                        help="1 adds DeepSeek-V3's multi-token-prediction layer (the speculative draft model)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    path = make_tiny_model(args.directory, arch=args.arch, seed=args.seed,
                           fp8_block=(128, 128) if args.fp8 else None, mtp_layers=args.mtp_layers)
    print(path)
    return 0
