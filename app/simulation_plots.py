"""The plots of a simulated comparison (``staleflow simulate --out``): throughput per system (whole run,
with the steady state marked), staleness per buffer, time per step and the per-instance skew per step
for each ``eta``, as PNG files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from staleflow.app.report import pyplot


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Write the PNG plots of a comparison report into ``out``; returns their paths."""
    plt = pyplot()
    written = []
    bound = report["upper_bound_tokens_per_s"]
    etas = list(report["by_eta"])
    names = list(next(iter(report["by_eta"].values()))["systems"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) * len(etas)), 4))
    width = 0.8 / max(1, len(etas))
    for j, eta in enumerate(etas):
        systems = report["by_eta"][eta]["systems"]
        where = [i + j * width for i in range(len(names))]
        ax.bar(where, [systems[n]["tokens_per_s"] for n in names], width, label=f"eta={eta}")
        steady = [(x, systems[n]["steady_tokens_per_s"]) for x, n in zip(where, names) if systems[n]["steady_tokens_per_s"]]
        ax.scatter([x for x, _ in steady], [y for _, y in steady], marker="_", s=300, color="black",
                   label="steady state (first eta + 2 steps left out)" if j == 0 else None, zorder=3)
    ax.axhline(bound, color="black", linestyle="--", label="upper bound")
    ax.set_xticks([i + width * (len(etas) - 1) / 2 for i in range(len(names))], names, rotation=20, ha="right")
    ax.set_ylabel("trained tokens / s")
    ax.set_title(f"{report['workload']}: throughput")
    ax.legend()
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    for eta in etas:
        systems = report["by_eta"][eta]["systems"]
        cols = min(4, len(systems))
        rows = -(-len(systems) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
        for ax in axes.flat[len(systems):]:
            ax.axis("off")
        for ax, (name, figures) in zip(axes.flat, systems.items()):
            per_buffer = figures["staleness_per_buffer"]
            buffers = sorted(per_buffer, key=int)
            levels = sorted({int(s) for counts in per_buffer.values() for s in counts})
            bottom = [0] * len(buffers)
            for level in levels:
                counts = [per_buffer[b].get(str(level), 0) for b in buffers]
                ax.bar([int(b) for b in buffers], counts, bottom=bottom, label=f"staleness {level}")
                bottom = [x + y for x, y in zip(bottom, counts)]
            ax.set_title(name)
            ax.set_xlabel("buffer (training step)")
        for row in axes:
            row[0].set_ylabel("groups")
        axes.flat[0].legend(fontsize="small")
        fig.suptitle(f"staleness per buffer, eta={eta}")
        fig.tight_layout()
        path = out / f"staleness_eta{eta}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for name, figures in systems.items():
            ax.plot(range(1, len(figures["step_times_s"]) + 1), figures["step_times_s"], label=name)
        ax.set_xlabel("training step")
        ax.set_ylabel("step time (s)")
        ax.set_title(f"time per step, eta={eta}")
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"step_times_eta{eta}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        written.append(_skew_plot(plt, systems, eta, out / f"instance_skew_eta{eta}.png"))
    return written


def _skew_plot(plt: Any, systems: dict[str, Any], eta: str, path: Path) -> Path:
    """Per step: the spread of the tokens each instance generated (median line, min-max band), the
    coefficient of variation of the trajectories finished per instance, and the mean instance
    utilisation (the paper's Fig. 4)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for name, figures in systems.items():
        steps = figures["instance_skew"]["per_step"]
        x = range(1, len(steps) + 1)
        line = axes[0].plot(x, [s["tokens"]["median"] for s in steps], label=name)[0]
        axes[0].fill_between(x, [s["tokens"]["min"] for s in steps], [s["tokens"]["max"] for s in steps],
                             color=line.get_color(), alpha=0.15)
        axes[1].plot(x, [s["trajectories"]["cv"] for s in steps], label=name)
        axes[2].plot(x, [s["utilisation"] for s in steps], label=name)
    for ax, label in zip(axes, ("tokens per instance (median, min-max)", "CV of trajectories per instance",
                                "mean instance utilisation")):
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
    axes[2].set_ylim(0, 1.05)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"per-instance skew, eta={eta}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
