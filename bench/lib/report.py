"""docs/benchmarks.md, the one page of the benchmarks, rendered from their results files
(bench/results/, bench.lib.results.RECORDS) and the notes written by hand beside each
section (bench/notes/): the page from its sections (bench.lib.sections, a module each),
and the page published with its figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.lib.plots import draw, draw_replicas
from bench.lib.results import records
from bench.lib.sections.anchors import anchors_section
from bench.lib.sections.choices import choices_section
from bench.lib.sections.common import PLANNER_FIGURES
from bench.lib.sections.loads import loads_section
from bench.lib.sections.planner import planner_section
from bench.lib.sections.planner_dynamo import planner_dynamo_section
from bench.lib.sections.routing import routing_section
from bench.lib.sections.scale import scale_section
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
}


def page(results: dict[str, dict[str, Any]]) -> str:
    """docs/benchmarks.md from `results` (by record name): a section per record there."""
    lines = ["# Benchmarks: Prism against `vllm serve`", "", *loads_section(results)]
    lines += [render(results[name]) for name, render in SECTIONS.items() if name in results]
    return "\n".join(lines)


def publish(doc: Path, latest: dict[str, dict[str, Any]] | None = None) -> None:
    """Renders `doc` from the results files, with `latest` (a run's results, by record
    name) in place of theirs, and draws the image load's figures beside it."""
    shown = records() | (latest or {})
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(page(shown))
    if "image" in shown:
        draw(doc.parent, shown["image"]["rows"])
    for name, figure in PLANNER_FIGURES.items():
        if name in shown:
            draw_replicas(doc.parent / figure, shown[name])
