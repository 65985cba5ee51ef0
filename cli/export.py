"""``staleflow export RUN_DIR [--step N] --out DIR [--dtype bf16|fp32]``: a trained model as a Hugging Face folder
(the work: :mod:`staleflow.app.export`). Exit 0 on success, 2 for bad input (no such run, step or checkpoint,
weights of another model, an output folder that is not empty, a shard size that is not a size).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory of staleflow train")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights' dtype (default bf16)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 500MB, 2GB (default 2GB)")


def run(args: argparse.Namespace) -> int:
    from staleflow.app import export

    try:
        result = export.export(
            args.run_dir, args.out, step=args.step, dtype=args.dtype, max_shard_bytes=parse_size(args.max_shard_size)
        )
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        print(f"staleflow export: {error}", file=sys.stderr)
        return 2
    print(
        f"exported {result['checkpoint']} ({result['tensors']} tensors, {result['parameters']:,} parameters, "
        f"{result['dtype']}) to {result['out']} in {result['shards']} shard(s)"
    )
    return 0


def parse_size(text: str) -> int:
    """``500MB``, ``2GB``, ``1.5G``... in bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if match is None:
        raise ValueError(f"--max-shard-size {text!r} is not a size like 500MB or 2GB")
    return int(float(match.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[match.group(2)])
