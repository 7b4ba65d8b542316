"""Renders docs/benchmarks.md from the benchmarks' results files, the page's one source.

    .venv/bin/python -m bench.render            # rewrite docs/benchmarks.md
    .venv/bin/python -m bench.render --check    # exit 1 if the committed page is out of date
    .venv/bin/python -m bench.render --figures  # also redraw every figure beside it

Every section comes from its record in bench/results/ (bench.lib.results.RECORDS), and
links the notes written by hand for it in bench/notes/ rather than pasting them; a bench
writes its record and renders the page again itself. Nothing is run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.lib.report import figures, page
from bench.lib.results import records

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "benchmarks.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the file instead of writing it"
    )
    parser.add_argument("--figures", action="store_true", help="redraw the figures beside it")
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    shown = records(ROOT)
    text = page(shown)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(
                f"{args.out} is out of date: run `make docs` (python -m bench.render) and "
                "commit the result",
                file=sys.stderr,
            )
            return 1
        return 0
    args.out.write_text(text)
    if args.figures:
        figures(args.out.parent, shown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
