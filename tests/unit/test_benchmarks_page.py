"""docs/benchmarks.md is rendered from the benchmarks' results files (bench/results/) and
the notes beside them (bench/notes/) by bench/render.py: it must be what they render now.
Pure: reads the files, renders, compares; runs no bench."""

from __future__ import annotations

import re
from pathlib import Path

from bench import render
from bench.lib.report import page
from bench.lib.results import records

ROOT = Path(__file__).resolve().parents[2]


def test_benchmarks_md_is_what_the_results_render():
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert committed == page(records(ROOT)), (
        "docs/benchmarks.md is out of date: run `make docs` (python -m bench.render) and "
        "commit the result"
    )


def test_every_figure_the_page_shows_is_committed():
    figures = re.findall(r"\]\((benchmarks-\w+\.png)\)", page(records(ROOT)))
    assert figures
    for name in figures:
        assert (ROOT / "docs" / name).exists(), name


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
