"""Figures of the image load, drawn beside the page that shows them."""

from __future__ import annotations

from pathlib import Path

# Each figure: the measure it plots, its label, and its name (benchmarks-<name>.png).
FIGURES = (
    ("requests_per_s", "requests/s", "rps"),
    ("ttft_ms_p50", "TTFT p50 (ms)", "ttft"),
    ("itl_ms_p50", "inter-token latency p50 (ms)", "itl"),
)


def draw(directory: Path, rows: list[dict]) -> None:
    """Each figure as a PNG in `directory`: every server's measure by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r["server"] for r in rows))
    for key, label, name in FIGURES:
        figure, axes = plt.subplots(figsize=(6, 4))
        for server in servers:
            points = [(r["concurrency"], r[key]) for r in rows if r["server"] == server]
            axes.plot(*zip(*points, strict=True), marker="o", label=server)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrency")
        axes.set_ylabel(label)
        axes.legend()
        axes.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(directory / f"benchmarks-{name}.png", dpi=110)
        plt.close(figure)


def draw_replicas(path: Path, result: dict) -> None:
    """The figure at `path`: each run's replicas of each role over the step load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    figure, grid = plt.subplots(
        len(rows), 1, figsize=(7, 1.6 * len(rows) + 0.6), sharex=True, squeeze=False
    )
    panes = grid[:, 0]
    phase_s = result["settings"]["phase_s"]
    for pane, row in zip(panes, rows, strict=True):
        roles = dict.fromkeys(k for r in row["replicas"] for k in r if k != "t")
        for role in roles:
            points = [(r["t"], r[role]) for r in row["replicas"]]
            if points:
                pane.step(*zip(*points, strict=True), where="post", label=role)
        for edge in range(1, len(result["phases"])):
            pane.axvline(edge * phase_s, color="grey", alpha=0.4)
        pane.set_ylabel("replicas")
        pane.set_ylim(0, result["settings"]["budget"] + 0.5)
        pane.set_title(f"{row['run']}: SLO attainment {row['attainment']:.0%}", fontsize=9)
        pane.grid(alpha=0.3)
    panes[0].legend(loc="upper right", fontsize=8)
    panes[-1].set_xlabel("seconds (" + " | ".join(result["phases"]) + ")")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
