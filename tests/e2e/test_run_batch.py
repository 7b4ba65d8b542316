"""`prism run-batch -i IN -o OUT`, as a user runs it: every line answered in the input's order
as offline vLLM answers it, a malformed line and a refused request among them failing
alone; a file that cannot run refused before anything starts."""

from __future__ import annotations

import subprocess
import sys

from support.batches import CHATS, batch_line, entries

SIX = CHATS[:6]


def _line(custom_id: str, name: str, **fields) -> str:
    return batch_line("m", custom_id, name, **fields)


def _run_batch(tmp_path, model, lines: list[str]) -> tuple[subprocess.CompletedProcess, list]:
    given, written = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    given.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "prism.cli", "--log-level", "warning", "run-batch", "-i",
         str(given), "-o", str(written), "--model", str(model), "--served-model-name", "m",
         "--mode", "epd"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return done, entries(written.read_text()) if written.exists() else []


def test_run_batch_answers_every_line_in_order_and_fails_bad_ones_alone(models, oracle, tmp_path):
    expected = oracle("llava")
    lines = [_line(f"c{i}", name) for i, name in enumerate(SIX)]
    lines[2:2] = ["{not json"]
    lines.append(_line("hot", SIX[0], temperature=7))
    done, written = _run_batch(tmp_path, models["llava"], lines)
    assert done.returncode == 0, done.stderr
    assert [e["custom_id"] for e in written] == ["c0", "c1", None, *[f"c{i}" for i in range(2, 6)],
                                                 "hot"]  # fmt: skip
    answered = [e for e in written if e["custom_id"] and e["custom_id"] != "hot"]
    texts = [e["response"]["body"]["choices"][0]["message"]["content"] for e in answered]
    assert texts == [expected[name]["text"] for name in SIX]
    assert written[2]["error"]["code"] == "invalid_line"
    assert written[-1]["response"]["status_code"] == 400
    assert "6 answered, 2 failed" in done.stderr


def test_a_file_that_cannot_run_is_refused_before_anything_starts(models, tmp_path):
    done, written = _run_batch(tmp_path, models["llava"], [_line("a", SIX[0]),
                                                             _line("a", SIX[1])])  # fmt: skip
    assert done.returncode == 2 and "custom_id 'a' is used twice" in done.stderr
    assert written == [] and "stage" not in done.stderr
