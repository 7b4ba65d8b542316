"""The page's figures, drawn beside it: the image load's, each planner run's replicas, and
the summary's (the anchors, the front at scale, routing, the planners' attainment)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Each figure: the measure it plots, its label, and its name (benchmarks-<name>.png).
FIGURES = (
    ("requests_per_s", "requests/s", "rps"),
    ("ttft_ms_p50", "TTFT p50 (ms)", "ttft"),
    ("itl_ms_p50", "inter-token latency p50 (ms)", "itl"),
)


def pyplot() -> ModuleType:
    """matplotlib's pyplot, drawing to files alone. Imported when first drawn: the page's
    text renders without it (`make lint`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure: Figure, path: Path, top: float = 1.0) -> None:
    """`figure` as a PNG at `path`, laid out below `top` (a share of its height); closed."""
    figure.tight_layout(rect=(0, 0, 1, top))
    figure.savefig(path, dpi=110)
    pyplot().close(figure)


def draw(directory: Path, rows: list[dict]) -> None:
    """Each figure as a PNG in `directory`: every server's measure by concurrency."""
    plt = pyplot()
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
        save(figure, directory / f"benchmarks-{name}.png")


def draw_replicas(path: Path, result: dict) -> None:
    """The figure at `path`: each run's replicas of each role over the step load."""
    plt = pyplot()
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
    save(figure, path)


def bars(axes: Axes, groups: list[str], series: dict[str, list[float]]) -> None:
    """Grouped bars on `axes`: a group per label of `groups`, a bar of each series in each."""
    width = 0.8 / len(series)
    for n, (label, values) in enumerate(series.items()):
        axes.bar([g + (n - (len(series) - 1) / 2) * width for g in range(len(groups))], values,
                 width, label=label)  # fmt: skip
    axes.set_xticks(range(len(groups)), groups)
    axes.grid(alpha=0.3, axis="y")


def draw_anchors(path: Path, result: dict) -> None:
    """The figure at `path`: every server's requests/s at each concurrency, side by side
    (bench/serve.py --anchors' record)."""
    plt = pyplot()
    rows = result["rows"]
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["server"], r["concurrency"]): r["requests_per_s"] for r in rows}
    servers = list(dict.fromkeys(r["server"] for r in rows))
    figure, axes = plt.subplots(figsize=(8, 3.6))
    # A level a server did not run is no bar (NaN), not a bar at zero.
    series = {s: [by.get((s, c), float("nan")) for c in levels] for s in servers}
    bars(axes, [f"concurrency {c}" for c in levels], series)
    axes.set_ylabel("requests/s")
    axes.legend(fontsize=7, ncol=3)
    save(figure, path)


def draw_scale(path: Path, result: dict) -> None:
    """The figure at `path`: each front's requests/s and TTFT p99 against the streams
    (bench/scale.py's record)."""
    plt = pyplot()
    rows = result["rows"]
    figure, (rate, ttft) = plt.subplots(1, 2, figsize=(8, 3.4))
    for front in dict.fromkeys(r["front"] for r in rows):
        mine = [r for r in rows if r["front"] == front]
        streams = [r["streams"] for r in mine]
        rate.plot(streams, [r["requests_per_s"] for r in mine], marker="o", label=front)
        ttft.plot(streams, [r["ttft_ms_p99"] for r in mine], marker="o", label=front)
    levels = sorted({r["streams"] for r in rows})
    for axes, label in ((rate, "requests/s"), (ttft, "TTFT p99 (ms)")):
        axes.set_xscale("log", base=2)
        # The levels themselves on the axis, not powers of two.
        axes.set_xticks(levels, [str(s) for s in levels])
        axes.minorticks_off()
        axes.set_xlabel("streams")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    rate.legend(fontsize=7)
    save(figure, path)


def draw_routing(path: Path, result: dict) -> None:
    """The figure at `path`: each policy's prefix-cache hit rate and TTFT p50, by mode and
    concurrency (bench/routing.py's record)."""
    plt = pyplot()
    lines = result["summary"]
    groups = list(dict.fromkeys((r["mode"], r["concurrency"]) for r in lines))
    by = {(r["mode"], r["concurrency"], r["policy"]): r for r in lines}
    policies = list(dict.fromkeys(r["policy"] for r in lines))
    labels = [f"{mode} c={c}" for mode, c in groups]
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(8, 3.4))
    for axes, key, scale, label in ((hits, "hit_rate", 100, "prefix-cache hit rate (%)"),
                                    (ttft, "ttft_ms_p50", 1, "TTFT p50 (ms)")):  # fmt: skip
        series = {
            p: [scale * by[(*g, p)][key] if (*g, p) in by else float("nan") for g in groups]
            for p in policies
        }
        bars(axes, labels, series)
        axes.set_ylabel(label)
    # Above both panes, in room kept for it: within one it would cover the bars.
    figure.legend(*hits.get_legend_handles_labels(), loc="upper center", ncol=len(policies),
                  fontsize=8)  # fmt: skip
    save(figure, path, top=0.9)


def draw_planners(path: Path, records: list[tuple[str, dict]]) -> None:
    """The figure at `path`: each run's SLO attainment, a pane per planner record (its
    title, the record)."""
    plt = pyplot()
    figure, panes = plt.subplots(1, len(records), figsize=(3.2 * len(records), 2.8), squeeze=False)
    for pane, (title, result) in zip(panes[0], records, strict=True):
        rows = result["rows"]
        colours = ["tab:orange" if "planner" in r["run"] else "tab:blue" for r in rows]
        shown = pane.barh([r["run"] for r in rows], [100 * r["attainment"] for r in rows],
                          color=colours)  # fmt: skip
        pane.bar_label(shown, fmt="%.0f%%", fontsize=7, padding=2)
        pane.set_xlim(0, 110)
        pane.set_xticks(range(0, 101, 25))
        pane.set_xlabel("SLO attainment (%)")
        pane.set_title(title, fontsize=9)
        pane.grid(alpha=0.3, axis="x")
        pane.invert_yaxis()
    save(figure, path)
