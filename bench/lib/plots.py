"""Figures of the image load, beside the page that shows them."""

from __future__ import annotations

from pathlib import Path


def plots(path: Path, rows: list[dict]) -> list[str]:
    """PNG plots of the image load beside `path`, and the markdown that shows them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r["server"] for r in rows))
    shown = []
    for key, label, name in (("requests_per_s", "requests/s", "rps"),
                             ("ttft_ms_p50", "TTFT p50 (ms)", "ttft"),
                             ("itl_ms_p50", "inter-token latency p50 (ms)", "itl")):  # fmt: skip
        figure, axes = plt.subplots(figsize=(6, 4))
        for server in servers:
            points = [(r["concurrency"], r[key]) for r in rows if r["server"] == server]
            axes.plot(*zip(*points, strict=True), marker="o", label=server)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrency")
        axes.set_ylabel(label)
        axes.legend()
        axes.grid(alpha=0.3)
        image = path.parent / f"benchmarks-{name}.png"
        figure.tight_layout()
        figure.savefig(image, dpi=110)
        plt.close(figure)
        shown.append(f"![{label}]({image.name})")
    return shown
