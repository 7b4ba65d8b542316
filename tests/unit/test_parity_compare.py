"""The oracle's comparison (`bench.parity.compare`): per prompt, equal or the first
differing position with both sides' margin there, and a tie where the offline engine's own
top two were equal and the mesh took the other one. Pure: answers are written out here."""

from __future__ import annotations

from bench.parity import compare

OFFLINE = {
    "token_ids": [1, 2, 3],
    "top": [{"1": -1.0, "5": -2.0}, {"2": -1.5, "9": -1.5, "7": -3.0}, {"3": -0.5}],
}


def _mesh(second: int) -> dict:
    return {
        "token_ids": [1, second, 3],
        "top": [{"1": -1.0}, {str(second): -1.49, "2": -1.5}, {"3": -0.5}],
    }


def test_equal_answers_are_equal_with_nothing_more():
    assert compare([OFFLINE], [_mesh(2)]) == [{"equal": True, "tokens": 3}]


def test_the_other_of_two_tied_tokens_is_a_tie_with_both_margins():
    (row,) = compare([OFFLINE], [_mesh(9)])
    assert row["first_difference"] == 1 and not row["equal"]
    assert row["margin_offline"] == 0.0 and row["margin_mesh"] > 0
    assert row["tie"]


def test_a_token_the_offline_engine_ranked_lower_is_no_tie():
    (row,) = compare([OFFLINE], [_mesh(7)])
    assert row["first_difference"] == 1 and not row["tie"]
