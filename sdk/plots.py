"""A job's curves as PNG files, drawn from its recorded events (what any client can read, so nothing is stored
for them on the service): loss per step and held-out loss per eval pass, and for an RL job its mean reward per
step."""

from collections.abc import Iterable
from pathlib import Path

from inkwell.service.schemas import JobEvent


def write_plots(events: Iterable[JobEvent], directory: Path, name: str, title: str) -> dict[str, Path]:
    """`<name>-loss.png` and, when the events report rewards, `<name>-reward.png` in `directory`; the paths by
    curve. Nothing is written for a job without progress yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, held_out, reward = [], [], []
    for event in events:
        data = event.data
        if event.type == "progress" and data.get("loss") is not None:
            train.append((data["step"], data["loss"]))
        if event.type == "progress" and data.get("reward") is not None:
            reward.append((data["step"], data["reward"]))
        if event.type == "eval" and data.get("eval_loss") is not None:
            held_out.append((data["step"], data["eval_loss"]))
    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    def save(curve: str, fig) -> None:
        fig.tight_layout()
        paths[curve] = directory / f"{name}-{curve}.png"
        fig.savefig(paths[curve], dpi=100)
        plt.close(fig)

    if train:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(*zip(*train, strict=True), label="train loss")
        if held_out:
            ax.plot(*zip(*held_out, strict=True), "o-", label="held-out loss")
        # an RL loss (reward minus its group's mean, weighted) is near 0 and of either sign: no log scale
        ax.set(xlabel="step", ylabel="loss", yscale="linear" if reward else "log", title=title)
        ax.legend()
        save("loss", fig)
    if reward:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(*zip(*reward, strict=True), "o-", markersize=3)
        ax.set(xlabel="step", ylabel="mean reward", ylim=(-0.02, 1.02), title=title)
        save("reward", fig)
    return paths
