"""docs/benchmarks.md is rendered from the benchmarks' results files (bench/results/) by
bench/render.py and must be what they render now. It opens with a summary of where Prism
stands, every figure of it computed from the records, and holds only generated text: the
notes written by hand (bench/notes/) are linked, not pasted. Pure: reads the records,
renders, compares; runs no bench and draws no figure."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from bench import render
from bench.lib.report import page
from bench.lib.results import records
from bench.lib.sections import anchors, scale
from bench.lib.sections.summary import TARGETS, summary_section

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Where Prism stands"
# A figure as the page writes it: not a label's digits (TTFT p50), nor a name's (x86_64).
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
# The goals and bars the summary checks the records against: the code's, not a record's.
GOALS = (anchors.RPS_GOAL, anchors.TTFT_GOAL_MS, anchors.TAX_GOAL, scale.LOW_BAR,
         scale.TOP_BAR, scale.TTFT_BAR)  # fmt: skip


def summary(results: dict[str, dict[str, Any]]) -> str:
    """The summary section of the page `results` render."""
    text = page(results)
    start = text.index(HEADING)
    end = text.find("\n## ", start)
    return text[start:end]


def held(node: Any, strings: set[str], numbers: list[float]) -> None:
    """Every string and number under `node`, a record or a part of one."""
    if isinstance(node, dict):
        for value in node.values():
            held(value, strings, numbers)
    elif isinstance(node, list):
        for value in node:
            held(value, strings, numbers)
    elif isinstance(node, str):
        strings.add(node)
    elif isinstance(node, int | float) and not isinstance(node, bool):
        numbers.append(node)


def test_the_summary_opens_the_page_in_at_most_40_lines():
    text = page(records(ROOT))
    headings = re.findall(r"^## .*", text, re.M)
    assert headings[0] == HEADING
    assert text.startswith("# Benchmarks")
    lines = summary(records(ROOT)).rstrip("\n").splitlines()
    assert len(lines) <= 40, len(lines)


def test_every_image_the_page_shows_is_in_docs():
    text = page(records(ROOT))
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    # One per comparison of the summary at least, and the sections' own.
    assert len(re.findall(r"!\[", summary(records(ROOT)))) >= 5
    missing = [name for name in images if not (ROOT / "docs" / name).is_file()]
    assert not missing, f"run `python -m bench.render --figures`: {missing}"


def test_the_notes_are_linked_not_pasted():
    text = page(records(ROOT))
    notes = sorted((ROOT / "bench" / "notes").glob("*.md"))
    assert notes
    for path in notes:
        for paragraph in path.read_text().split("\n\n"):
            paragraph = paragraph.strip()
            # Short ones (a title, a table's rule) may be any page's words.
            if len(paragraph) > 60:
                assert paragraph not in text, f"{path.name} pasted into the page: {paragraph}"
    linked = re.findall(r"\]\(\.\./(bench/notes/[\w.-]+\.md)\)", text)
    assert "bench/notes/image.md" in linked and "bench/notes/anchors.md" in linked
    assert all((ROOT / path).is_file() for path in linked)


def test_a_section_with_notes_ends_with_their_link():
    section = page(records(ROOT)).split("## Beside NVIDIA Dynamo")[1].split("\n## ")[0]
    last = section.strip().splitlines()[-1]
    assert last.startswith("Notes on these runs") and "bench/notes/anchors.md" in last


def test_every_figure_in_the_summary_is_one_a_record_holds():
    results = records(ROOT)
    strings: set[str] = set()
    numbers: list[float] = list(GOALS)
    # The records the summary reads, and no other: the fewer figures, the fewer chance matches.
    held([results[name] for name in TARGETS if name in results], strings, numbers)
    text = summary(results)
    # What a record names (its date, machine, model, runs) is its own words, not a figure.
    for name in sorted((s for s in strings if re.search(r"\d", s)), key=len, reverse=True):
        text = text.replace(name, " ")
    figures = NUMBER.findall(text)
    assert len(figures) > 40
    strays = []
    for figure in figures:
        digits = len(figure.partition(".")[2])
        forms = {f"{abs(v):.{digits}f}" for v in numbers} | {
            f"{abs(100 * v):.{digits}f}" for v in numbers
        }
        if figure not in forms:
            strays.append(figure)
    assert not strays, f"figures no record holds: {strays}"


def changed(results: dict[str, dict[str, Any]], name: str, **fields: Any) -> None:
    results[name] = results[name] | fields


def test_the_image_load_line_follows_its_record():
    results = records(ROOT)
    before = summary(results)
    changed(results, "image", epd_vs_vllm_serve_rps_ratio=1.23456)
    changed(results, "image", epd_minus_vllm_serve_ttft_p50_ms_c1=-1.0)
    after = summary(results)
    line = next(line for line in after.splitlines() if "image load against" in line)
    assert "1.23x" in line and "-1.0" in line and line.endswith(": met.")
    assert after != before


def test_the_anchors_goals_follow_their_record():
    results = records(ROOT)
    before = summary(results)
    met = int(re.search(r"(\d+) of \d+ goals met", before).group(1))
    changed(results, "anchors", epd_vs_vllm_serve_rps_ratio=1.5)
    changed(results, "anchors", epd_minus_vllm_serve_ttft_p50_ms_c1=0.5)
    after = summary(results)
    assert f"{met + 1} of " in after and "| epd | vllm serve | 1.50 | +0.5 |" in after


def test_the_scale_line_follows_its_record():
    results = records(ROOT)
    front = next(b for b in scale.front_bars(results["scale"]))
    top = max(r["streams"] for r in results["scale"]["rows"])
    changed(results, "scale", **{f"{front.front}_vs_dynamo_rps_ratio_s{top}": 0.987})
    assert f"{front.front} {front.low_rps:.2f}x, 0.99x" in summary(results)


def test_the_routing_line_follows_its_record():
    results = records(ROOT)
    first, *rest = results["routing"]["summary"]
    changed(results, "routing", summary=[first | {"hit_rate": 0.0123}, *rest])
    assert f"{first['policy']} 1.2%" in summary(results)


def test_the_planners_lines_follow_their_records():
    results = records(ROOT)
    rows = [r | {"attainment": 0.4321} if r["run"] == "planner" else r
            for r in results["planner"]["rows"]]  # fmt: skip
    changed(results, "planner", rows=rows)
    assert "planner 43%" in summary(results)


@pytest.mark.parametrize("name", ["image", "anchors", "scale", "routing", "planner_dynamo"])
def test_each_comparison_names_its_runs_date_and_machine(name):
    results = records(ROOT)
    changed(results, name, when="2031-02-03 04:05 UTC", machine="a test bench, 96 cores")
    assert "2031-02-03 04:05 UTC, a test bench, 96 cores" in summary(results)


def test_without_the_records_it_compares_there_is_no_summary():
    results = records(ROOT)
    assert summary_section({"choices": results["choices"]}) == []
    assert HEADING not in page({"choices": results["choices"]})


def test_benchmarks_md_is_what_the_results_render():
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert committed == page(records(ROOT)), (
        "docs/benchmarks.md is out of date: run `make docs` (python -m bench.render) and "
        "commit the result"
    )


def test_a_record_not_written_leaves_its_section_out():
    shown = records(ROOT)
    del shown["scale"], shown["video"]
    text = page(shown)
    assert "## The front at scale" not in text and "## Video load" not in text
    assert "## Routing by what each worker holds" in text


def test_a_run_in_place_of_its_record_is_what_the_page_shows():
    shown = records(ROOT)
    shown["choices"] = shown["choices"] | {"when": "a run of its own"}
    assert "`make bench-choices` on a run of its own" in page(shown)


def test_check_mode_reports_a_stale_page(tmp_path):
    stale = tmp_path / "benchmarks.md"
    stale.write_text("# old\n")
    assert render.main(["--check", "--out", str(stale)]) == 1
    assert render.main(["--out", str(stale)]) == 0
    assert render.main(["--check", "--out", str(stale)]) == 0


def test_a_scale_row_with_failures_shows_its_commonest_reasons():
    shown = records(ROOT)
    first, *rest = shown["scale"]["rows"]
    reasons = {"timeout": 5, "HTTP 503: a | b": 3, "stream error: x": 2, "HTTP 500: y": 1}
    failing = first | {"failures": 11, "failure_reasons": reasons}
    shown["scale"] = shown["scale"] | {"rows": [failing, *rest]}
    assert "| 11 (timeout x5; HTTP 503: a \\| b x3; stream error: x x2; 1 more) |" in page(shown)
