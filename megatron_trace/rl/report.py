"""The PNG report at the end of a run: reward, train-rollout mismatch and flip rates per step."""

from __future__ import annotations

from pathlib import Path


def plot_report(history: list[dict], path: str | Path, title: str = "") -> Path:
    """Reward and k3_kl per RL step (log scale), side by side. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("plot_report: no steps to plot")
    steps = [m["step"] for m in history]
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_r.plot(steps, [m["reward"] for m in history], marker=".")
    ax_r.set(xlabel="RL step", ylabel="mean reward", title="reward")
    ax_k.semilogy(steps, [max(m["k3_kl"], 1e-18) for m in history], marker=".", color="tab:red")
    ax_k.set(xlabel="RL step", ylabel="k3_kl (train vs rollout)", title="train-rollout mismatch")
    for ax in (ax_r, ax_k):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
