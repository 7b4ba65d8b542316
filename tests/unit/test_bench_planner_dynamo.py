"""bench/planner_dynamo.py's pure parts: the fixed splits it reads, the decisions it reads
back from Prism's planner's log, how a run's requests count (an abandoned one is a miss,
not a failure), and the page's cells. Pure: nothing is started or sent."""

from __future__ import annotations

import argparse
import time

import pytest

from bench.lib.sections.common import mean_replicas
from bench.lib.sections.planner_dynamo import by_phase
from bench.planner import summarize
from bench.planner_dynamo import PHASES, PDLoad, prism_decisions, splits

LOG = """\
2026-11-27 22:39:40,001 INFO prism.planner [] planner: planning local (ep/d) from x
2026-11-27 22:39:44,879 INFO prism.planner [] planner: prefill 1 → 3 (queue; ttft p90 2350 ms, itl p90 24 ms, first replies {}, busy {})
2026-11-27 22:40:21,127 INFO prism.planner [] planner: decode 1 → 2 (itl; ttft p90 -, itl p90 31 ms, first replies {}, busy {})
"""  # noqa: E501


def load() -> PDLoad:
    args = argparse.Namespace(
        prompt_rate=2.5, answer_rate=2.0, long_words=100, short_words=10, short_tokens=16,
        long_tokens=600, ttft_slo_ms=3000.0, itl_slo_ms=30.0,
    )  # fmt: skip
    return PDLoad(args)


def test_splits_are_read_by_role_and_must_fill_the_budget():
    assert splits("3+1,2+2", 4) == [{"prefill": 3, "decode": 1}, {"prefill": 2, "decode": 2}]
    assert splits("", 4) == []
    with pytest.raises(SystemExit, match="2\\+1 is not a split"):
        splits("2+1", 4)


def test_prism_decisions_come_back_from_its_log_in_seconds_from_the_start():
    begun = time.mktime(time.strptime("2026-11-27 22:39:40", "%Y-%m-%d %H:%M:%S"))
    decisions = prism_decisions(LOG, begun)
    assert [d.pop("t") for d in decisions] == pytest.approx([4.879, 41.127])
    assert decisions == [{"prefill": 3, "why": "queue"}, {"decode": 2, "why": "itl"}]


def test_the_load_has_a_rate_and_a_shape_for_each_phase(monkeypatch):
    # The corpus' words load torch (prism.devtools): any words will do here.
    monkeypatch.setattr("bench.planner_dynamo.words", lambda tag, count: " ".join([tag] * count))
    shaped = load()
    assert shaped.phases == PHASES and shaped.rates == [2.5, 2.0, 2.5] and shaped.abandon
    assert shaped.body("m", "prompts", 1)["max_tokens"] == 16
    body = shaped.body("m", "answers", 1)
    assert body["max_tokens"] == 600 and body["ignore_eos"] and body["stream"]
    assert len(body["messages"][0]["content"].split()) == 10


def test_an_abandoned_request_is_a_miss_and_not_a_failure():
    outcomes = [
        {"phase": 0, "ok": True, "ttft_s": 1.0, "itl_s": 0.02},
        {"phase": 1, "ok": True, "ttft_s": 1.0, "itl_s": 0.05},
        {"phase": 1, "ok": False, "error": "timeout", "abandoned": True},
        {"phase": 2, "ok": False, "error": "HTTP 503: gone"},
    ]
    row = summarize("run", {"outcomes": outcomes, "replicas": [], "seconds": 10.0}, load())
    assert (row["failed"], row["abandoned"], row["errors"]) == (1, 1, ["HTTP 503: gone"])
    assert row["attainment"] == 0.25
    assert [row[f"attainment_{n}_{p}"] for n, p in enumerate(PHASES)] == [1.0, 0.0, 0.0]
    assert row["itl_s_p90_2_prompts"] is None


def test_the_page_counts_every_role_and_marks_a_phase_none_answered():
    row = {"replicas": [{"t": 0, "prefill": 1, "decode": 1}, {"t": 1, "prefill": 3, "decode": 1}],
           "ttft_s_p90_0_prompts": 1.25, "ttft_s_p90_1_answers": None,
           "ttft_s_p90_2_prompts": 12.0}  # fmt: skip
    assert mean_replicas(row) == 3.0
    assert by_phase(row, "ttft_s", list(PHASES), 1) == "1.2 / - / 12.0"
