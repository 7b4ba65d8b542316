"""docs/benchmarks.md, the one page of the benchmarks, rendered from their results files
(bench/results/, bench.lib.results.RECORDS) alone: the page from its sections
(bench.lib.sections, a module each; the notes written by hand, bench/notes/, linked from
them), and the page published with its figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.lib.plots import (
    draw,
    draw_anchors,
    draw_planners,
    draw_replicas,
    draw_routing,
    draw_scale,
)
from bench.lib.results import records
from bench.lib.sections.anchors import anchors_section
from bench.lib.sections.batch import batch_section
from bench.lib.sections.choices import choices_section
from bench.lib.sections.common import PLANNER_FIGURES, PLANNER_TITLES, SUMMARY_FIGURES
from bench.lib.sections.loads import loads_section
from bench.lib.sections.planner import planner_section
from bench.lib.sections.planner_dynamo import planner_dynamo_section
from bench.lib.sections.routing import routing_section
from bench.lib.sections.scale import scale_section
from bench.lib.sections.summary import summary_section
from bench.lib.sections.vllm_bench import vllm_bench_section

# The sections after the loads', in the page's order, by the record each renders.
SECTIONS = {
    "anchors": anchors_section,
    "scale": scale_section,
    "routing": routing_section,
    "planner": planner_section,
    "planner_vllm": planner_section,
    "planner_dynamo": planner_dynamo_section,
    "choices": choices_section,
    "vllm_bench": vllm_bench_section,
    "batch": batch_section,
}
# The summary's figures drawn from one record each, by its name.
SUMMARY_DRAWN = {"anchors": draw_anchors, "scale": draw_scale, "routing": draw_routing}


def page(results: dict[str, dict[str, Any]]) -> str:
    """docs/benchmarks.md from `results` (by record name): the summary, then a section per
    record there."""
    lines = ["# Benchmarks: Prism against `vllm serve`", ""]
    lines += [*summary_section(results), *loads_section(results)]
    lines += [render(results[name]) for name, render in SECTIONS.items() if name in results]
    return "\n".join(lines)


def figures(directory: Path, results: dict[str, dict[str, Any]]) -> None:
    """Draws into `directory` every figure of the page whose record is in `results`."""
    if "image" in results:
        draw(directory, results["image"]["rows"])
    for name, figure in PLANNER_FIGURES.items():
        if name in results:
            draw_replicas(directory / figure, results[name])
    for name, drawn in SUMMARY_DRAWN.items():
        if name in results:
            drawn(directory / SUMMARY_FIGURES[name], results[name])
    planners = [(title, results[name]) for name, title in PLANNER_TITLES.items()
                if name in results]  # fmt: skip
    if planners:
        draw_planners(directory / SUMMARY_FIGURES["planners"], planners)


def publish(doc: Path, latest: dict[str, dict[str, Any]] | None = None) -> None:
    """Renders `doc` from the results files, with `latest` (a run's results, by record
    name) in place of theirs, and draws its figures beside it."""
    shown = records() | (latest or {})
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(page(shown))
    figures(doc.parent, shown)
