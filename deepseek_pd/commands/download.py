"""`deepseek-pd download`: make a model source ready on this machine (a pod's init container).

    deepseek-pd download --source huggingFace --repo deepseek-ai/DeepSeek-V3 --revision main \\
        --cache-dir /model-cache            # token from $HF_TOKEN; prints the checkpoint directory
    deepseek-pd download --source pvc --path /models/DeepSeek-V3      # no download: checks the path

Exit codes and the termination message are the failure reasons of deepseek_pd.weights.failures,
which the operator turns into the ModelReady condition (False, reason = the failure).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

SOURCES = ("huggingFace", "pvc", "hostPath")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "download", help="download a Hugging Face checkpoint (resumable) or check a pvc/hostPath one",
        description="Make a model source ready: huggingFace downloads a snapshot into --cache-dir "
                    "(resumable, verified, once per volume), pvc/hostPath check --path. Prints the "
                    "checkpoint directory. The token comes from $HF_TOKEN.")
    parser.add_argument("--source", choices=SOURCES, required=True, help="where the weights come from")
    parser.add_argument("--repo", help="huggingFace: repository id, e.g. deepseek-ai/DeepSeek-V3")
    parser.add_argument("--revision", default="main", help="huggingFace: branch, tag or commit (default main)")
    parser.add_argument("--cache-dir", type=Path, help="huggingFace: the model cache volume")
    parser.add_argument("--path", type=Path, help="pvc/hostPath: the checkpoint directory")
    parser.add_argument("--endpoint", default=None,
                        help="huggingFace: Hub URL (default: huggingface_hub's, which honours $HF_ENDPOINT)")
    parser.add_argument("--max-workers", type=int, default=8, help="files fetched at once (default 8)")
    parser.add_argument("--attempts", type=int, default=3,
                        help="passes over the snapshot on network errors, each resuming the last (default 3)")
    parser.add_argument("--retry-wait", type=float, default=5.0, help="seconds between attempts (default 5)")
    parser.add_argument("--progress-interval", type=float, default=10.0,
                        help="seconds between progress lines (default 10)")
    parser.add_argument("--termination-log", type=Path, default=None,
                        help="write '<Reason>: <message>' here on failure (in a pod: /dev/termination-log)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deepseek_pd.errors import UserError
    from deepseek_pd.weights.failures import DownloadError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        directory = _ready(args)
    except DownloadError as exc:
        print(f"deepseek-pd download: error: {exc.reason}: {exc.message}", file=sys.stderr)
        if args.termination_log is not None:
            try:
                args.termination_log.write_text(exc.termination_message())
            except OSError as write_error:
                print(f"deepseek-pd download: cannot write {args.termination_log}: {write_error}",
                      file=sys.stderr)
        return exc.exit_code
    except UserError:
        raise  # bad flags: the CLI prints it and exits 2
    print(directory)
    return 0


def _ready(args: argparse.Namespace) -> Path:
    from deepseek_pd.errors import UserError

    if args.source != "huggingFace":
        from deepseek_pd.weights.local_source import check_local_checkpoint

        if args.path is None or args.repo or args.cache_dir:
            raise UserError(f"--source {args.source} takes --path only (no --repo/--cache-dir)")
        return check_local_checkpoint(args.path, args.source)
    if not args.repo or args.cache_dir is None or args.path is not None:
        raise UserError("--source huggingFace needs --repo and --cache-dir (and no --path)")
    from deepseek_pd import env
    from deepseek_pd.weights.hub_download import DownloadConfig, HubSource, download_snapshot

    try:
        config = DownloadConfig(args.cache_dir, token=env.hf_token(), max_workers=args.max_workers,
                                attempts=args.attempts, retry_wait_s=args.retry_wait,
                                progress_interval_s=args.progress_interval)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return download_snapshot(HubSource(args.repo, args.revision, args.endpoint), config)
