"""Response lengths as the workloads' length model: measured on recorded samples, or fitted to stated figures.

``--samples FILE`` (the samples file of ``staleflow bench draft-acceptance``: ``{"group": id, "tokens":
[ids]}`` per line, several samples per prompt): the groups' mean length and share at ``--cap``, the ICC
of their log lengths (one-way ANOVA, F interval) and the maximum-likelihood length model (responses at
``--cap`` or longer taken as cut there), its ICC with a bootstrap interval over prompts
(``--bootstrap N``). ``--mean M --clip-ratio C --cap N --icc I``: the length model with that mean,
clip ratio at the cap and ICC, as a workload's ``response_tokens``; ``--clipped-means CAP:MEAN ...
--cap N --icc I``: the same from mean lengths stated under two token budgets or more.
All: ``runtime/settings/length_fit.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from staleflow.bench.draft_acceptance import read_samples
from staleflow.runtime.settings.length_fit import fit_to_clipped_means, fit_to_samples, fit_to_targets, icc_anova


def add_arguments(parser: argparse.ArgumentParser) -> None:
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--samples", type=Path, help='JSONL of sampled responses, one per line: {"group": id, "tokens": [ids]}')
    given.add_argument("--mean", type=float, help="fit: the mean response length (of the clipped lengths)")
    given.add_argument("--clipped-means", nargs="+", metavar="CAP:MEAN", help="fit: mean lengths under two caps or more")
    parser.add_argument("--cap", type=int, help="the generation cap (--samples: lengths at or above it count as cut; fit: required)")
    parser.add_argument("--clip-ratio", type=float, help="fit: the share of responses cut at --cap")
    parser.add_argument("--icc", type=float, help="fit: the share of the log-length variance a prompt's group shares")
    parser.add_argument("--min", type=int, default=16, help="the length model's shortest response (default: 16)")
    parser.add_argument("--bootstrap", type=int, default=0, help="--samples: refits over prompts drawn with replacement (default: 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def from_samples(args: argparse.Namespace) -> dict[str, Any]:
    groups = [[len(tokens) for tokens in group] for group in read_samples(args.samples).values()]
    lengths = [n for group in groups for n in group]
    anova = icc_anova(groups)
    fit = fit_to_samples(groups, cap=args.cap, bootstrap=args.bootstrap, seed=args.seed)
    return {"groups": len(groups), "responses": len(lengths), "mean": sum(lengths) / len(lengths),
            "at_cap": sum(n >= args.cap for n in lengths) / len(lengths) if args.cap else 0.0,
            "icc_anova": [anova.icc, anova.low, anova.high],
            "fit": {"mu": fit.mu, "sigma": fit.sigma, "prompt_sigma": fit.prompt_sigma, "icc": fit.icc,
                    "icc_bootstrap": [fit.icc_low, fit.icc_high], "censored": fit.censored}}


def from_targets(args: argparse.Namespace) -> dict[str, Any]:
    needed = [("--cap", args.cap), ("--icc", args.icc)] + ([] if args.clipped_means else [("--clip-ratio", args.clip_ratio)])
    missing = [flag for flag, value in needed if value is None]
    if missing:
        raise ValueError(f"a fit needs --mean and --clip-ratio, or --clipped-means, with --cap and --icc (missing {', '.join(missing)})")
    if args.clipped_means:
        try:
            means = {int(cap): float(mean) for cap, mean in (item.split(":") for item in args.clipped_means)}
        except ValueError:
            raise ValueError(f"--clipped-means takes CAP:MEAN pairs, got {' '.join(args.clipped_means)}") from None
        lengths = fit_to_clipped_means(means, args.cap, args.icc, args.min)
    else:
        lengths = fit_to_targets(args.mean, args.clip_ratio, args.cap, args.icc, args.min)
    return {"response_tokens": {"distribution": "lognormal", "mean": round(lengths.mean, 1), "sigma": lengths.sigma,
                                "prompt_sigma": lengths.prompt_sigma, "min": args.min, "max": args.cap},
            "mu": lengths.mu, "clip_ratio": lengths.truncated_share()}


def run(args: argparse.Namespace) -> int:
    try:
        figures = from_samples(args) if args.samples else from_targets(args)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(figures, indent=1))
    elif args.samples:
        fit, icc = figures["fit"], figures["icc_anova"]
        print(f"{figures['groups']} groups, {figures['responses']} responses, mean {figures['mean']:,.0f} tokens, "
              f"{figures['at_cap']:.1%} at the cap {args.cap or '(none given)'}")
        print(f"ICC of the log lengths (one-way ANOVA): {icc[0]:.3f}, 95% interval {icc[1]:.3f}-{icc[2]:.3f}")
        interval = f", bootstrap 95% interval {fit['icc_bootstrap'][0]:.3f}-{fit['icc_bootstrap'][1]:.3f}" if args.bootstrap else ""
        print(f"length model (maximum likelihood, {fit['censored']} censored): mu {fit['mu']:.3f}, sigma {fit['sigma']:.3f}, "
              f"prompt_sigma {fit['prompt_sigma']:.3f}, ICC {fit['icc']:.3f}{interval}")
    else:
        spec = figures["response_tokens"]
        print(f"response_tokens: {{distribution: lognormal, mean: {spec['mean']:g}, sigma: {spec['sigma']:.4f}, "
              f"prompt_sigma: {spec['prompt_sigma']:.4f}, min: {spec['min']}, max: {spec['max']}}}  "
              f"(mu {figures['mu']:.4f}, clip ratio {figures['clip_ratio']:.2%})")
    return 0
