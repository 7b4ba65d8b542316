"""`--config FILE`: a command's flags from a YAML file, as vLLM's `--config` reads them.

Each key is a flag's name (`http-port` or `http_port`), each value its value: a list for
a repeatable flag, true for a switch. Flags given on the command line win over the
file's. The keys of `prism serve` and `prism worker` that are not Prism's are vLLM's
engine arguments, checked by vLLM's parser as the same flags given would be; any other
command refuses a key it does not know, by name. `--print-config` writes a command's
resolved flags as such a file (secrets left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from prism.config.common import LogConfig
from prism.config.flags import Flags, flag, option

OPTION = "--config"
# The flags before a command, whose values could be mistaken for one.
_GLOBAL_FLAGS = {option(field.name) for field in dataclasses.fields(LogConfig)}


@dataclass
class ConfigFileConfig(Flags):
    """A command's flags from a file, and the resolved ones written out."""

    config: str = flag(
        "",
        "read flags from this YAML file, one key per flag (`http-port: 8000`; a list for "
        "a repeatable one); flags given here win over the file's",
        metavar="FILE",
    )
    print_config: bool = flag(
        False, "print the command's resolved flags as a --config file, and exit"
    )


def commands(parser: argparse.ArgumentParser) -> Mapping[str, argparse.ArgumentParser]:
    """The subcommands of `parser`, by name (none where it has none)."""
    # argparse lists a parser's subcommands nowhere public: its actions hold them.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def expand(
    argv: list[str], parser: argparse.ArgumentParser, passes_unknown: Collection[str] = ()
) -> list[str]:
    """`argv` with its command's `--config FILE` replaced by the file's flags, put before
    the command's others, less those the command line gives itself. `passes_unknown`:
    the commands whose flags Prism does not know are vLLM's."""
    at, command, leaf = _command(argv, parser)
    if leaf is None:
        return argv
    rest = argv[at + 1 :]
    path, rest = _take_option(rest)
    if path is None:
        return argv
    values = load(path)
    actions = {name: action for action in leaf._actions for name in action.option_strings}
    given = {token.split("=", 1)[0] for token in rest if token.startswith("--")}
    added: list[str] = []
    for key, value in values.items():
        name = "--" + str(key).replace("_", "-")
        action = actions.get(name)
        if action is None and command not in passes_unknown:
            raise ValueError(f"{path}: `prism {command}` has no flag {name} (key {key!r})")
        if given & set(action.option_strings if action else (name,)):
            continue
        added += _render(name, value, known=action is not None)
    return [*argv[: at + 1], *added, *rest]


def load(path: str) -> dict[str, Any]:
    """The flags a config file holds, by key."""
    try:
        with open(path) as file:
            values = yaml.safe_load(file)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not YAML: {exc}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of flags to values")
    return values


def dump(configs: list[Flags], vllm: Mapping[str, Any] | None = None) -> str:
    """`configs` (and `vllm`, vLLM's engine arguments as its parser read them, by
    field) as a --config file."""
    values: dict[str, Any] = {}
    for config in configs:
        values |= config.flag_values()
    values |= {name.replace("_", "-"): value for name, value in (vllm or {}).items()}
    return yaml.safe_dump({name: _plain(value) for name, value in values.items()},
                          sort_keys=False)  # fmt: skip


def _command(
    argv: list[str], parser: argparse.ArgumentParser
) -> tuple[int, str, argparse.ArgumentParser | None]:
    """Where the command (and, for `deploy kubernetes`, its own subcommand) ends in
    `argv`, its name, and its parser (None where there is no command)."""
    names = commands(parser)
    at = next((i for i, token in enumerate(argv) if token in names and (
        i == 0 or argv[i - 1] not in _GLOBAL_FLAGS)), None)  # fmt: skip
    if at is None:
        return 0, "", None
    command, leaf = argv[at], names[argv[at]]
    while (inner := commands(leaf)) and at + 1 < len(argv) and argv[at + 1] in inner:
        at += 1
        leaf = inner[argv[at]]
    return at, command, leaf


def _take_option(tokens: list[str]) -> tuple[str | None, list[str]]:
    """The value of --config among `tokens`, and the tokens without it."""
    for i, token in enumerate(tokens):
        if token == OPTION and i + 1 < len(tokens):
            return tokens[i + 1], [*tokens[:i], *tokens[i + 2 :]]
        if token.startswith(OPTION + "="):
            return token.split("=", 1)[1], [*tokens[:i], *tokens[i + 1 :]]
    return None, tokens


def _render(name: str, value: Any, known: bool) -> list[str]:
    """A key's value as its flag takes it on a command line."""
    if isinstance(value, bool):
        # Prism's switches are off by default; vLLM's booleans say --no-NAME.
        if value:
            return [name]
        return [] if known else [f"--no-{name[2:]}"]
    if isinstance(value, list):
        return [token for item in value for token in _render(name, item, known)]
    if isinstance(value, dict):
        return [name, json.dumps(value)]
    if value is None:
        return []
    return [name, str(value)]


def _plain(value: Any) -> Any:
    """`value` as YAML holds it."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
