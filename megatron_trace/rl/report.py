"""What a run writes for people: metrics.jsonl and TensorBoard scalars (`MetricsLog`), and the
PNG report of reward and train-rollout mismatch per step and flip rates by layer, for one run or
several (one line / bar group per run mode)."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """metrics.jsonl (one JSON object per RL step) and TensorBoard scalars under out_dir/tb. A
    resumed run keeps the rows before `first_step` and recomputes the rest."""

    def __init__(self, out_dir: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # slow to import: only where a run logs

        self.path = out_dir / "metrics.jsonl"
        rows = [line for line in self.path.read_text().splitlines() if line.strip()] if self.path.exists() else []
        kept = [r for r in rows if json.loads(r)["step"] < first_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(r + "\n" for r in kept))
        tmp.replace(self.path)
        self.history = [json.loads(r) for r in kept]
        self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=first_step)

    def write(self, m: dict) -> None:
        """Append one step's metrics (numbers, and {layer: number} dicts) to both logs."""
        line = json.dumps(m)
        self.history.append(json.loads(line))  # as a resumed run reads it back (layer keys as strings)
        with self.path.open("a") as f:
            f.write(line + "\n")
        for k, v in m.items():
            if isinstance(v, (int, float)) and k != "step":
                self.tb.add_scalar(k, v, m["step"])
            elif isinstance(v, dict):  # per layer
                for layer, x in v.items():
                    self.tb.add_scalar(f"{k}/{layer}", x, m["step"])
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()


def plot_report(runs: dict[str, list[dict]] | list[dict], path: str | Path, title: str = "") -> Path:
    """Reward and k3_kl per RL step (log scale), and the mean flip rate per layer (round to
    nearest vs the engine; hatched: the residual after guidance). `runs`: {label: metrics rows}
    or one run's rows. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {"": runs} if isinstance(runs, list) else runs
    if not runs or not all(runs.values()):
        raise ValueError("plot_report: no steps to plot")
    fig, (ax_r, ax_k, ax_f) = plt.subplots(1, 3, figsize=(15, 3.8))
    bars = []
    for i, (label, rows) in enumerate(runs.items()):
        color = f"C{i}"
        steps = [m["step"] for m in rows]
        ax_r.plot(steps, [m["reward"] for m in rows], marker=".", color=color, label=label or None)
        trained = [m for m in rows if "k3_kl" in m]  # a step dynamic sampling skipped has no trainer forward
        ax_k.semilogy([m["step"] for m in trained], [max(m["k3_kl"], 1e-18) for m in trained], marker=".",
                      color=color, label=label or None)
        for key, hatch in (("flip_rate_by_layer", None), ("residual_flip_rate_by_layer", "//")):
            per_step = [m[key] for m in rows if key in m]
            if per_step:
                layers = sorted(per_step[0], key=int)
                mean = [sum(d[L] for d in per_step) / len(per_step) for L in layers]
                bars.append((f"{label} {'residual' if hatch else 'flip'}".strip(), layers, mean, color, hatch))
    width = 0.8 / max(1, len(bars))
    for j, (name, layers, mean, color, hatch) in enumerate(bars):
        ax_f.bar([int(L) + j * width for L in layers], mean, width, color=color, hatch=hatch,
                 alpha=0.5 if hatch else 0.9, label=name)
    ax_r.set(xlabel="RL step", ylabel="mean reward", title="reward")
    ax_k.set(xlabel="RL step", ylabel="k3_kl (train vs rollout)", title="train-rollout mismatch")
    ax_f.set(xlabel="layer", ylabel="fraction of FP4 elements", title="flip rate by layer (mean over steps)")
    if bars:
        ax_f.set_xticks(sorted({int(L) for _, layers, *_ in bars for L in layers}))
    else:
        ax_f.text(0.5, 0.5, "no FP4 trainer in these runs", ha="center", va="center", transform=ax_f.transAxes)
    for ax in (ax_r, ax_k, ax_f):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
