"""``staleflow profile``: measure a real vLLM engine's decode latency and fit the cost model (the work:
:mod:`staleflow.app.profile`). Exit 0 when the coefficients are written, 2 for arguments that do not fit."""

from __future__ import annotations

import argparse
import json
import sys

#: the profile grid's defaults: running requests n, and prompt lengths in tokens
DEFAULT_BATCH_SIZES = (1, 4, 16, 48, 96, 160)
DEFAULT_PROMPT_LENGTHS = (16, 128, 384)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="job config overrides; the engine is built with the job's rollout settings, e.g. rollout.gpus_per_instance=1")
    parser.add_argument("--config", metavar="YAML", help="job file whose rollout settings (dtype, CUDA graphs, tensor parallelism) "
                        "the profiled engine uses (default: the built-in job)")
    parser.add_argument("--model", help="local model folder (default: the built-in tiny model, see model.tiny_model_dir)")
    parser.add_argument("--out", default="cost_model.json", help="coefficients file to write, .json or .yaml (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the full result (points, fit) as JSON")
    parser.add_argument(
        "--batch-sizes", type=_int_list, default=DEFAULT_BATCH_SIZES, help="running requests n, comma-separated (default %(default)s)"
    )
    parser.add_argument(
        "--prompt-lengths", type=_int_list, default=DEFAULT_PROMPT_LENGTHS, help="prompt tokens, comma-separated (default %(default)s)"
    )
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens each request generates (default %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from staleflow.app import profile

    longest = max(args.prompt_lengths) + args.decode_tokens
    if longest > args.max_model_len:
        print(f"error: longest prompt + decode tokens = {longest} exceeds --max-model-len {args.max_model_len}", file=sys.stderr)
        return 2
    from staleflow.runtime.settings.config import ConfigError

    try:
        engine_kwargs = profile.run_engine_settings(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    result = profile.profile_model(
        args.model, out=args.out, batch_sizes=args.batch_sizes, prompt_lengths=args.prompt_lengths,
        decode_tokens=args.decode_tokens, max_model_len=args.max_model_len, seed=args.seed,
        engine_kwargs=engine_kwargs, log=log,
    )
    if args.json:
        print(json.dumps({**result.to_dict(), "out": str(args.out)}, indent=2))
    else:
        coefficients = ", ".join(f"{k}={v:.4g}" for k, v in result.model.to_dict().items())
        print(f"fitted on {len(result.points)} points ({result.steps} decode steps) in {result.seconds:.1f} s")
        print(f"coefficients: {coefficients}")
        print(f"peak decode throughput {result.peak_tokens_per_s:.0f} tokens/s; in-place reload {result.reload_ms:.1f} ms")
        print(f"fit error: mean {result.report.mean_relative_error:.1%}, max {result.report.max_relative_error:.1%} (paper: 10.5% mean)")
        print(f"wrote {args.out}; the prior of staleflow train on this device: coordinator.cost_model.profile={args.out}")
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values
