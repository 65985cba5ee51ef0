"""Markdown tables of ``staleflow simulate`` grids over several seeds (docs/simulation.md, README).

Each argument is a ``results.json`` written by ``staleflow simulate --out DIR`` (one workload, one
seed, one or more ``eta``). Runs of the same workload, seed, coordinator tick and GPU split are merged
(a grid of baselines, a grid of ``staleflow-authors``, a grid of ablations); runs at another tick
make a tick-sensitivity table instead. Then for each workload and ``eta`` every system's trained tokens/s is given as
the median over seeds with its range, StaleFlow's ratio to it as the median of the per-seed ratios
with their range, and a system that trains past ``eta`` gets its worst p99/max staleness and share
of groups past ``eta`` over the seeds. "Mean over eta" averages each seed's ratios over ``eta``,
then gives the median and range of those means over the seeds. Ratios are given on both comparison
bases (over each system the paper ran, as it runs, and their best; over the best baseline that keeps
the bound) and for the whole run and the steady state (the first ``eta + 2`` steps left out).

    python scripts/simulate_tables.py runs/*/results.json > tables.md
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

#: The systems the paper ran, as they run (the paper's comparison basis), then the baselines it did not
#: run: the variants a careful user would run and ROLL's later code (the bound-keeping basis counts them too).
PAPER_SYSTEMS = ("verl-sync", "one-step-off", "verl-async", "areal", "roll-flash")
BASELINES = (*PAPER_SYSTEMS, "areal-filter", "areal-tight", "roll-flash-2026")
#: Baselines with one mechanism idealised: columns of a grid where they ran, never the best bound-keeping one.
BASELINE_ABLATIONS = ("roll-flash-ideal-routing",)
#: StaleFlow as another code base runs it: columns beside ``staleflow``, measured against the same baselines.
STALEFLOW_VARIANTS = ("staleflow-authors", "staleflow-authors-sync99", "staleflow-no-recompute")
BEST = "best bound-keeping"
BEST_PAPER = "best paper system"
#: The figure a ratio compares: the whole run's trained tokens/s, or the steady state's (the first
#: eta + 2 steps left out, ``steady_tokens_per_s`` in results.json).
WHOLE, STEADY = "tokens_per_s", "steady_tokens_per_s"


def load(paths: list[str]) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, dict[str, dict[int, dict[str, Any]]]]]:
    """The grids at each workload's own coordinator tick (workload -> seed -> {"bound", "steps",
    "by_eta": {eta: {system: figures}}}), and every run by tick (workload -> tick -> the same; the
    tick ``"default"`` is the workload's own: results written before ``tick_s`` was recorded ran at it)."""
    grids: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    ticks: dict[str, dict[str, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for path in paths:
        report = json.loads(Path(path).read_text())
        tick = report.get("tick_s")
        at_default = tick is None or tick == report.get("workload_tick_s")
        if at_default:
            _merge(grids[report["workload"]], report, path)
        _merge(ticks[report["workload"]]["default" if at_default else f"{tick:g} s"], report, path)
    return grids, ticks


def _merge(seeds: dict[int, dict[str, Any]], report: dict[str, Any], path: str) -> None:
    """Add ``report``'s systems to its seed's run in ``seeds``."""
    run = seeds.setdefault(report["seed"], {"bound": report["upper_bound_tokens_per_s"], "steps": report["steps"], "by_eta": {},
                                            "rollout_bound": report["upper_bound"]["rollout_tokens_per_s"]})
    if run["steps"] != report["steps"]:
        raise SystemExit(f"{path}: {report['steps']} steps, other runs of this seed have {run['steps']}")
    for eta, figures in report["by_eta"].items():
        run["by_eta"].setdefault(int(eta), {}).update(figures["systems"])


def spread(values: list[float], fmt: str, unit: str = "") -> str:
    """Median, and the range over seeds when there are several: ``1.02x [0.98, 1.05]``."""
    median = format(statistics.median(values), fmt) + unit
    return median if len(values) == 1 else f"{median} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def share(fraction: float) -> str:
    """A share of trained groups: ``2.0%``, or ``<0.1%`` for a few groups of many (never ``0.0%``)."""
    return f"{fraction:.1%}" if fraction >= 0.0005 else "<0.1%"


def best_keeping(systems: dict[str, Any], eta: int, key: str = WHOLE) -> tuple[str, float]:
    """The fastest baseline whose p99 staleness is within ``eta`` (what ``simulate`` calls best-bound-keeping)."""
    keeping = [(f[key], name) for name, f in systems.items()
               if name in BASELINES and f["staleness_p99"] <= eta and f[key] > 0]
    speed, name = max(keeping)
    return name, speed


def best_paper(systems: dict[str, Any], key: str = WHOLE) -> tuple[str, float]:
    """The fastest system the paper ran, as it runs (what ``simulate`` calls best-paper-system)."""
    speed, name = max((f[key], name) for name, f in systems.items() if name in PAPER_SYSTEMS and f[key] > 0)
    return name, speed


def with_system(seeds: dict[int, dict[str, Any]], name: str) -> dict[int, dict[str, Any]]:
    """The seeds that ran ``name`` at every eta (``BEST``: every seed, over the baselines it ran)."""
    return {s: run for s, run in seeds.items()
            if name in (BEST, BEST_PAPER) or all(name in systems for systems in run["by_eta"].values())}


def ratios(seeds: dict[int, dict[str, Any]], eta: int, name: str, over: str = "staleflow", key: str = WHOLE) -> list[float]:
    """``over`` (StaleFlow, or a variant of it) over ``name`` (a system, ``BEST`` or ``BEST_PAPER``)
    per seed at ``eta``, on ``key`` (whole run or steady state)."""
    out = []
    for run in with_system(with_system(seeds, over), name).values():
        systems = run["by_eta"][eta]
        other = best_keeping(systems, eta, key)[1] if name == BEST else best_paper(systems, key)[1] if name == BEST_PAPER \
            else systems[name][key]
        out.append(systems[over][key] / other)
    return out


def both(seeds: dict[int, dict[str, Any]], eta: int, name: str, over: str = "staleflow") -> str:
    """The ratio on the whole run and in steady state: ``1.02x [0.98, 1.05] (steady 1.10x [..])``."""
    return f"{spread(ratios(seeds, eta, name, over), '.2f', 'x')} (steady {spread(ratios(seeds, eta, name, over, STEADY), '.2f', 'x')})"


def binding_side(run: dict[str, Any], eta: int) -> str:
    """What holds StaleFlow back at ``eta`` in one seed's run: ``training`` (the trainer busy at least
    90% of the time), ``rollout`` (the fleet generating at 90% or more of the upper bound's rollout
    rate), else ``tail`` (the trainer waits for stragglers while the fleet has room)."""
    figures = run["by_eta"][eta]["staleflow"]
    if figures["trainer_busy"] >= 0.9:
        return "training"
    return "rollout" if figures["generated_tokens_per_s"] >= 0.9 * run["rollout_bound"] else "tail"


def past_eta(seeds: dict[int, dict[str, Any]], eta: int, name: str) -> str:
    figures = [run["by_eta"][eta][name] for run in with_system(seeds, name).values()]
    worst = max(f["past_eta_share"] for f in figures)
    if worst == 0:
        return ""
    return (f"; p99/max {max(f['staleness_p99'] for f in figures)}/{max(f['max_staleness'] for f in figures)}, "
            f"up to {share(worst)} past eta")


def grid_table(workload: str, seeds: dict[int, dict[str, Any]]) -> list[str]:
    etas = sorted(next(iter(seeds.values()))["by_eta"])
    systems = [s for s in (*BASELINES, *BASELINE_ABLATIONS) if with_system(seeds, s)]
    variants = [s for s in STALEFLOW_VARIANTS if with_system(seeds, s)]
    first = next(iter(seeds.values()))
    ran = "; ".join(f"{name}: seeds {', '.join(map(str, sorted(with_system(seeds, name))))}"
                    for name in ("staleflow", *variants, *systems))
    lines = [f"Upper bound {first['bound']:,.0f} tokens/s; {first['steps']} steps; {ran}. "
             "Cells: tokens/s median [range over seeds]; StaleFlow's ratio to it, median [range] of the per-seed ratios; "
             "for a system past eta its worst p99/max staleness and share of trained groups past eta over the seeds; "
             "a variant of StaleFlow: its ratio to StaleFlow and to the best bound-keeping baseline. "
             "(steady ...): the same ratio without the first eta + 2 steps.", "",
             "| eta | staleflow | " + " | ".join((*variants, *systems)) + f" | {BEST_PAPER} | {BEST} |",
             "|---" * (len(variants) + len(systems) + 4) + "|"]
    for eta in etas:
        speeds = [run["by_eta"][eta]["staleflow"]["tokens_per_s"] for run in seeds.values()]
        share = [s / run["bound"] for s, run in zip(speeds, seeds.values())]
        cells = [f"{spread(speeds, ',.0f')} ({spread(share, '.0%')} of bound)"]
        for name in variants:
            figures = [run["by_eta"][eta][name] for run in with_system(seeds, name).values()]
            of_staleflow = [1 / r for r in ratios(seeds, eta, name)]
            cells.append(f"{spread([f['tokens_per_s'] for f in figures], ',.0f')} ({spread(of_staleflow, '.2f', 'x')} of staleflow; "
                         f"{spread(ratios(seeds, eta, BEST, over=name), '.2f', 'x')} best){past_eta(seeds, eta, name)}")
        for name in systems:
            figures = [run["by_eta"][eta][name] for run in with_system(seeds, name).values()]
            admits = figures[0]["admission_eta"]
            note = f" (admits at {admits})" if name == "areal-tight" and all(f["admission_eta"] == admits for f in figures) else \
                " (admits at " + "/".join(str(f["admission_eta"]) for f in figures) + ")" if name == "areal-tight" else ""
            wasted = f"; {spread([f['wasted_tokens'] for f in figures], ',.0f')} tokens wasted" if name == "areal-filter" else ""
            cells.append(f"{spread([f['tokens_per_s'] for f in figures], ',.0f')} {both(seeds, eta, name)}"
                         f"{note}{past_eta(seeds, eta, name)}{wasted}")
        names = sorted({best_paper(run["by_eta"][eta])[0] for run in seeds.values()})
        cells.append(f"{both(seeds, eta, BEST_PAPER)} ({', '.join(names)})")
        names = sorted({best_keeping(run["by_eta"][eta], eta)[0] for run in seeds.values()})
        cells.append(f"{both(seeds, eta, BEST)} ({', '.join(names)})")
        lines.append(f"| {eta} | " + " | ".join(cells) + " |")
    means = [f"**{mean_over_eta(seeds, etas, BEST, over=name)} best**" for name in variants]
    means += [f"**{mean_over_eta(seeds, etas, name)}**" for name in (*systems, BEST_PAPER, BEST)]
    lines.append("| mean over eta | | " + " | ".join(means) + " |")
    details = []
    for eta in etas:
        sf = [run["by_eta"][eta]["staleflow"] for run in seeds.values()]
        details.append(
            f"eta {eta}: step {spread([f['step_time_s'] for f in sf], '.0f')} s (steady "
            f"{spread([f['steady_step_time_s'] for f in sf], '.0f')} s), binds: "
            f"{'/'.join(sorted({binding_side(run, eta) for run in seeds.values()}))}, trainer busy "
            f"{spread([f['trainer_busy'] for f in sf], '.0%')}, {spread([f['proactive_aborted'] for f in sf], '.0f')} groups "
            f"re-queued ({spread([f['wasted_tokens'] for f in sf], ',.0f')} tokens wasted), mean trained length "
            f"{spread([f['mean_trained_length'] for f in sf], ',.0f')}")
    lines += ["", "StaleFlow (median [range] over seeds): " + "; ".join(details) + ".", broken(seeds)]
    return lines


def mean_over_eta(seeds: dict[int, dict[str, Any]], etas: list[int], name: str, over: str = "staleflow", key: str = WHOLE) -> str:
    """``over``'s ratio to ``name``: each seed's mean over ``etas``, median [range] over the seeds."""
    per_seed = [statistics.mean(ratios({s: run}, eta, name, over, key)[0] for eta in etas)
                for s, run in with_system(with_system(seeds, over), name).items()]
    return spread(per_seed, ".2f", "x")


def broken(seeds: dict[int, dict[str, Any]]) -> str:
    problems = [f"seed {s} eta {eta} {name}"
                for s, run in seeds.items() for eta, systems in run["by_eta"].items() for name, f in systems.items()
                if f["lost"] or f["duplicated"] or (f["keeps_bound"] and f["max_staleness"] > f["eta"])]
    return "Broken guarantees: " + (", ".join(problems) if problems else
                                    "none (lost/duplicated 0/0 everywhere, every bound-keeping system within its bound).")


def is_ablation(name: str) -> bool:
    """A StaleFlow with one strategy switched off (``simulate --systems ablation``), not a variant."""
    return name.startswith("staleflow-") and name not in STALEFLOW_VARIANTS


def ablation_table(seeds: dict[int, dict[str, Any]]) -> list[str]:
    seeds = {s: run for s, run in seeds.items() if any(is_ablation(n) for x in run["by_eta"].values() for n in x)}
    etas = sorted(next(iter(seeds.values()))["by_eta"])
    names = sorted({n for run in seeds.values() for systems in run["by_eta"].values() for n in systems if is_ablation(n)})
    lines = ["| eta | system | tokens/s | vs StaleFlow | step (s) | re-queued | wasted tokens | mean trained length |",
             "|---|---|---|---|---|---|---|---|"]
    for eta in etas:
        if not any(n in run["by_eta"][eta] for run in seeds.values() for n in names):
            continue
        for name in ("staleflow", *names):
            runs = [run["by_eta"][eta] for run in seeds.values() if name in run["by_eta"][eta]]
            if not runs:
                continue
            f = [r[name] for r in runs]
            change = "" if name == "staleflow" else \
                spread([100 * (r[name]["tokens_per_s"] / r["staleflow"]["tokens_per_s"] - 1) for r in runs], "+.1f", "%")
            lines.append(f"| {eta} | {name} | {spread([x['tokens_per_s'] for x in f], ',.0f')} | {change} | "
                         f"{spread([x['step_time_s'] for x in f], '.0f')} | {spread([x['proactive_aborted'] for x in f], '.0f')} | "
                         f"{spread([x['wasted_tokens'] for x in f], ',.0f')} | {spread([x['mean_trained_length'] for x in f], ',.0f')} |")
    return lines


def summary_table(grids: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """The paper's basis: one row per workload, StaleFlow's mean-over-eta ratio to each system the
    paper ran (with the worst share of groups it trained past eta and its largest lag) and to their best."""
    lines = ["| setting | seeds (StaleFlow/fewest) | " + " | ".join(PAPER_SYSTEMS) + f" | {BEST_PAPER} |",
             "|---" * (len(PAPER_SYSTEMS) + 3) + "|"]
    for workload, seeds in sorted(grids.items()):
        etas = sorted(next(iter(seeds.values()))["by_eta"])
        if not all(with_system(seeds, b) for b in BASELINES):
            continue
        cells = []
        for name in (*PAPER_SYSTEMS, BEST_PAPER):
            figures = [] if name == BEST_PAPER else [r["by_eta"][e][name] for r in with_system(seeds, name).values() for e in etas]
            worst = max((f["past_eta_share"] for f in figures), default=0.0)
            lag = f", up to {share(worst)} past eta, max lag {max(f['max_staleness'] for f in figures)}" if worst > 0 else ""
            cells.append(f"{mean_over_eta(seeds, etas, name)} (steady {mean_over_eta(seeds, etas, name, key=STEADY)}{lag})")
        fewest = min(len(with_system(seeds, name)) for name in BASELINES)
        lines.append(f"| {workload} | {len(with_system(seeds, 'staleflow'))}/{fewest} | " + " | ".join(cells) + " |")
    return lines


def of_bound(seeds: dict[int, dict[str, Any]], eta: int, key: str) -> str:
    """StaleFlow's share of the upper bound at ``eta`` (``key``: whole run or steady state), median over seeds."""
    return f"{statistics.median(r['by_eta'][eta]['staleflow'][key] / r['bound'] for r in seeds.values()):.0%}"


def bound_keeping_table(grids: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """The bound-keeping basis: one row per workload, StaleFlow over the best baseline whose p99
    staleness is within eta (variants included) and StaleFlow's variants over it; StaleFlow's share of
    the upper bound and what binds it at each eta."""
    variants = [v for v in STALEFLOW_VARIANTS if any(with_system(seeds, v) for seeds in grids.values())]
    lines = [f"| setting | {BEST} (whole run) | {BEST} (steady) | " + "".join(f"{v} over {BEST} | " for v in variants)
             + "StaleFlow of upper bound, whole/steady (per eta) | binds (per eta) |",
             "|---" * (len(variants) + 5) + "|"]
    for workload, seeds in sorted(grids.items()):
        etas = sorted(next(iter(seeds.values()))["by_eta"])
        if not all(with_system(seeds, b) for b in BASELINES):
            continue
        cells = [mean_over_eta(seeds, etas, BEST), mean_over_eta(seeds, etas, BEST, key=STEADY)]
        cells += [mean_over_eta(seeds, etas, BEST, over=v) if with_system(seeds, v) else "not run" for v in variants]
        cells.append("; ".join(f"{e}: {of_bound(seeds, e, WHOLE)}/{of_bound(seeds, e, STEADY)}" for e in etas))
        cells.append("; ".join(f"{e}: {'/'.join(sorted({binding_side(r, e) for r in seeds.values()}))}" for e in etas))
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return lines


def tick_table(ticks: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> list[str]:
    """For each workload run at other coordinator ticks: each system's tokens/s per tick and
    StaleFlow's ratio to it, on the seeds and ``eta`` every tick ran."""
    lines = ["| workload | eta | system | " + "tokens/s, StaleFlow's ratio, per tick | " + "change vs the workload's tick |",
             "|---|---|---|---|---|"]
    for workload, by_tick in sorted(ticks.items()):
        if len(by_tick) < 2 or "default" not in by_tick:
            continue
        labels = ["default", *sorted((t for t in by_tick if t != "default"), key=lambda t: float(t.split()[0]))]
        seeds = sorted(set.intersection(*(set(by_tick[t]) for t in labels)))
        for eta in sorted(set.intersection(*(set(by_tick[t][s]["by_eta"]) for t in labels for s in seeds))):
            names = set.intersection(*(set(by_tick[t][s]["by_eta"][eta]) for t in labels for s in seeds))
            for name in [n for n in ("staleflow", *STALEFLOW_VARIANTS, *BASELINES, *BASELINE_ABLATIONS) if n in names]:
                speed = {t: statistics.median(by_tick[t][s]["by_eta"][eta][name]["tokens_per_s"] for s in seeds) for t in labels}
                ratio = {t: statistics.median(by_tick[t][s]["by_eta"][eta]["staleflow"]["tokens_per_s"]
                                              / by_tick[t][s]["by_eta"][eta][name]["tokens_per_s"] for s in seeds) for t in labels}
                cells = "; ".join(f"{t}: {speed[t]:,.0f}" + ("" if name == "staleflow" else f" ({ratio[t]:.2f}x)") for t in labels)
                change = ", ".join(f"{t}: {100 * (speed[t] / speed['default'] - 1):+.1f}%" for t in labels[1:])
                lines.append(f"| {workload} | {eta} | {name} | {cells} | {change} |")
    return lines


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    grids, ticks = load(paths)
    print("### Summary: the paper's basis\n\n" + "\n".join(summary_table(grids)) + "\n")
    print("### Summary: the bound-keeping basis\n\n" + "\n".join(bound_keeping_table(grids)) + "\n")
    if len(tick_table(ticks)) > 2:
        print("### Tick sensitivity\n\n" + "\n".join(tick_table(ticks)) + "\n")
    for workload, seeds in sorted(grids.items()):
        print(f"### {workload}\n")
        run = next(iter(seeds.values()))
        if all(with_system(seeds, b) for b in BASELINES):
            print("\n".join(grid_table(workload, seeds)) + "\n")
        if any(is_ablation(n) for systems in run["by_eta"].values() for n in systems):
            print("\n".join(ablation_table(seeds)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
