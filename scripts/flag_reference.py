"""Writes docs/configuration.md, the flag reference, from the CLI's own argparse parsers.

    python scripts/flag_reference.py            # rewrite docs/configuration.md
    python scripts/flag_reference.py --check    # exit 1 if the committed file is out of date

The reference is built from `prism.cli.build_parser()` alone, with the environment
emptied while the parser is built, so that defaults read from environment variables
(`PRISM_API_KEY`, `PRISM_HEALTH`) do not leak into the file. Nothing is started.
"""

from __future__ import annotations

import argparse
import os
import sys
from enum import Enum
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "configuration.md"

HEADER = """\
# Configuration: every flag

Generated from the parsers in `prism/cli.py` by `scripts/flag_reference.py` (`make docs`);
do not edit by hand. `tests/unit/test_flag_reference.py` fails when this file is out of
date.

Defaults are shown as the parser holds them, with the environment empty: `--api-key`
also reads `PRISM_API_KEY`, `prism health`'s target `PRISM_HEALTH`, and `--consul-token`
falls back to `CONSUL_HTTP_TOKEN`. A flag marked "repeatable" may be given several times.

Every command that serves or deploys also takes its flags from a YAML file, `--config
FILE`: one key per flag (`http-port: 8000`, or `http_port`), a list for a repeatable one,
`true` for a switch; flags given on the command line win over the file's. Keys of `prism
serve` and `prism worker` that are not Prism's are vLLM's engine arguments, checked by
vLLM's parser; other commands refuse a key they do not know, by name. `--print-config`
writes a command's resolved flags as such a file (secrets left out). One example per
mode: `examples/*.yaml`. `--log-level` and `--log-format` are taken after the command too.
"""


def _cell(text: str) -> str:
    """`text` made safe for one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    value = action.default
    if value is None or value == argparse.SUPPRESS:
        return ""
    if isinstance(value, list):
        return ", ".join(f"`{item}`" for item in value)
    if isinstance(value, Enum):
        value = value.value
    if value == "":
        return "`''`"
    return f"`{value}`"


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}`"
    if action.nargs == 0:
        return names
    if action.choices is not None:
        shown = "{" + ",".join(str(getattr(c, "value", c)) for c in action.choices) + "}"
    elif action.metavar:
        shown = str(action.metavar)
    else:
        shown = action.dest.upper()
    if not action.option_strings:
        return f"`{shown}`" + (" (optional)" if action.nargs == "?" else "")
    return f"{names} `{shown}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    notes = []
    if action.required:
        notes.append("required")
    if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
        notes.append("repeatable")
    if notes:
        text = f"{text} ({', '.join(notes)})" if text else ", ".join(notes)
    return text


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand of `parser`, in the order they were added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
    return found


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """The tables of `parser`'s own arguments, one per argument group."""
    lines: list[str] = []
    for group in parser._action_groups:
        actions = [
            action
            for action in group._group_actions
            if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
            and action.help != argparse.SUPPRESS
        ]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments", "positional arguments"):
            lines += [f"*{group.title}*", ""]
        column = "argument" if group.title == "positional arguments" else "flag"
        lines += [f"| {column} | default | meaning |", "|---|---|---|"]
        for action in actions:
            lines.append(
                f"| {_cell(_flag(action))} | {_cell(_default(action))} | {_cell(_help(action))} |"
            )
        lines.append("")
    for exclusive in parser._mutually_exclusive_groups:
        names = ", ".join(f"`{action.option_strings[0]}`" for action in exclusive._group_actions)
        lines += [f"{'Exactly' if exclusive.required else 'At most'} one of {names}.", ""]
    return lines


def _sections(parser: argparse.ArgumentParser, command: str, vllm: tuple[str, ...]) -> list[str]:
    lines: list[str] = []
    for name, help_text, sub in _subcommands(parser):
        full = f"{command} {name}"
        children = _subcommands(sub)
        lines += [f"## `{full}`", ""]
        if help_text:
            lines += [help_text[0].upper() + help_text[1:] + ".", ""]
        if name in vllm and command == "prism":
            lines += [
                "Flags it does not know are vLLM engine arguments, read by vLLM's own parser "
                "as `vllm serve` reads them (`--max-num-seqs 8`, `--tensor-parallel-size 2`, "
                "...); the few that a worker's role decides are refused with the Prism flag "
                "to use instead.",
                "",
            ]
        if children:
            lines += ["Subcommands: " + ", ".join(f"`{full} {c}`" for c, _, _ in children), ""]
        lines += _options(sub)
        lines += _sections(sub, full, vllm)
    return lines


def _command_names(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """Every subcommand under `parser`, in the order of the sections."""
    names = []
    for name, _, sub in _subcommands(parser):
        names.append(f"`{command} {name}`")
        names += _command_names(sub, f"{command} {name}")
    return names


def render() -> str:
    """The whole reference, from the parsers as they are now."""
    with mock.patch.dict(os.environ, {}, clear=True):
        from prism import cli

        parser = cli.build_parser()
    vllm = tuple(cli._VLLM_FLAG_COMMANDS)
    commands = _command_names(parser, "prism")
    lines = [HEADER, "Commands: " + ", ".join(commands) + ".", ""]
    lines += ["## `prism`", "", "Flags of every command, given before it.", ""]
    lines += _options(parser)
    lines += _sections(parser, "prism", vllm)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the file instead of writing it"
    )
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(
                f"{args.out} is out of date: run `python scripts/flag_reference.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
