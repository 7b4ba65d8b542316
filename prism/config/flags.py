"""A flag declared once, on the dataclass field it fills, as vLLM's `EngineArgs` does.

The same declaration adds the flag to a parser (`add_cli_args`), reads it back from the
parsed namespace (`from_args`) and writes it on a stage's command line (`to_argv`), so
that `prism serve`, the stage it starts and `prism deploy kubernetes` cannot disagree on
a flag's name, type or default. A field made with `nested` holds another config, whose
flags are its parent's.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Self

_FLAG = "flag"
_NESTED = "nested"


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str | None
    aliases: tuple[str, ...]
    choices: Sequence[Any] | None
    metavar: str | None
    # Written on a stage's command line even at its default, where a reader of `ps` or of
    # a manifest should see it; other flags only when they differ from it.
    always: bool
    # Never written on a command line, which `ps` shows (the launcher passes it otherwise).
    secret: bool
    # The argument group it is listed under, where not its config's.
    group: str | None
    # The least value it takes: refused below, on the command line and in code alike.
    minimum: int | None = None
    # A list flag that takes several values at once as well as repeated (vLLM's
    # `--lora-modules a=X b=Y`).
    several: bool = False


def flag(
    default: Any = dataclasses.MISSING,
    help: str | None = None,
    *,
    factory: Callable[[], Any] | Any = dataclasses.MISSING,
    aliases: tuple[str, ...] = (),
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    always: bool = False,
    secret: bool = False,
    group: str | None = None,
    minimum: int | None = None,
    several: bool = False,
) -> Any:
    """A field and its flag, `--NAME-OF-FIELD` (after `aliases`); no default: required."""
    spec = Flag(help, aliases, choices, metavar, always, secret, group, minimum, several)
    return dataclasses.field(default=default, default_factory=factory, metadata={_FLAG: spec})


def nested(config: type[Flags]) -> Any:
    """A field holding a config whose flags are its parent's."""
    return dataclasses.field(default_factory=config, metadata={_NESTED: True})


def option(name: str) -> str:
    """The flag of field `name`."""
    return f"--{name.replace('_', '-')}"


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _argument(field: dataclasses.Field, kind: Any, default: Any) -> dict[str, Any]:
    """add_argument's keywords for `field`, of type `kind`, defaulting to `default`."""
    spec: Flag = field.metadata[_FLAG]
    keywords: dict[str, Any] = {"dest": field.name, "help": spec.help}
    if spec.metavar:
        keywords["metavar"] = spec.metavar
    if kind is bool:
        return keywords | {"action": "store_true"}
    if typing.get_origin(kind) is list:
        if spec.several:
            return keywords | {"action": "extend", "nargs": "+", "default": default}
        return keywords | {"action": "append", "default": default}
    if default is dataclasses.MISSING:
        keywords["required"] = True
    else:
        keywords["default"] = default
    # `int | None`: an int, or nothing given.
    if isinstance(kind, types.UnionType):
        base = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    else:
        base = kind
    if spec.minimum is not None:
        keywords["type"] = _at_least(base, spec.minimum)
    elif base is not str:
        keywords["type"] = base
    if spec.choices is not None:
        keywords["choices"] = spec.choices
    elif isinstance(base, type) and issubclass(base, enum.Enum):
        keywords["choices"] = list(base)
    return keywords


def _at_least(kind: Callable[[str], Any], minimum: int) -> Callable[[str], Any]:
    """argparse's `type` for a value of `kind` no less than `minimum`."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _group(parser: argparse.ArgumentParser, title: str | None) -> Any:
    """Where a flag of group `title` is added: the parser's group of that title, made on
    first use (configs may share one), or the parser itself (None)."""
    if title is None:
        return parser
    # argparse finds no group by title; `_action_groups` is where every parser keeps its
    # groups (unchanged since Python 2.7), and no table of our own could see a group made
    # by another caller of `add_argument_group`.
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _render(name: str, value: Any) -> list[str]:
    """`value` as the command line gives it to flag `name`."""
    if isinstance(value, bool):
        return [name] if value else []
    if isinstance(value, list):
        return [arg for item in value for arg in (name, str(item))]
    return [name, str(value)]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help that shows each flag's default, where it has one to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == "" or default == []:
            return action.help
        return super()._get_help_string(action)


class Flags:
    """A dataclass of flags (`flag`) and nested configs (`nested`); its other fields,
    which no flag sets, keep their defaults unless `from_args` is given them."""

    # The title of the argument group its flags are listed under (None: the parser's own).
    group: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            spec = field.metadata.get(_FLAG)
            value = getattr(self, field.name)
            if spec is not None and spec.minimum is not None and value < spec.minimum:
                raise ValueError(
                    f"{option(field.name)} must be at least {spec.minimum}, got {value}"
                )

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, override: bool = False, **defaults: Any
    ) -> None:
        """Adds its flags to `parser`; `defaults` replace some of theirs (by field). With
        `override`, flags a parent parser has too, hidden from this one's help: given
        here, they replace what was given there."""
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if field.metadata.get(_NESTED):
                hints[field.name].add_cli_args(parser, override, **defaults)
            elif _FLAG in field.metadata:
                spec: Flag = field.metadata[_FLAG]
                # A secret's default comes from the environment: from_args reads it there,
                # and --help never shows it.
                default = defaults.get(field.name, "" if spec.secret else _default(field))
                keywords = _argument(field, hints[field.name], default)
                if override:
                    keywords |= {"help": argparse.SUPPRESS, "default": argparse.SUPPRESS}
                target = _group(parser, spec.group or cls.group)
                target.add_argument(*spec.aliases, option(field.name), **keywords)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **others: Any) -> Self:
        """The config the parsed `args` hold, with `others` for fields no flag sets."""
        hints = typing.get_type_hints(cls)
        values = dict(others)
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if field.metadata.get(_NESTED):
                values[field.name] = hints[field.name].from_args(args)
            elif _FLAG in field.metadata:
                value = getattr(args, field.name)
                if field.metadata[_FLAG].secret and not value:
                    value = _default(field)
                values[field.name] = value
        return cls(**values)

    def flag_values(self) -> dict[str, Any]:
        """Every flag's value (but secret ones'), its nested configs' too, by the flag's
        name without its dashes."""
        values: dict[str, Any] = {}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if field.metadata.get(_NESTED):
                values |= value.flag_values()
            elif (spec := field.metadata.get(_FLAG)) and not spec.secret:
                values[option(field.name)[2:]] = value
        return values

    def to_argv(self) -> list[str]:
        """Its flags (but secret ones) as a command line that `from_args` reads back."""
        argv: list[str] = []
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if field.metadata.get(_NESTED):
                argv += value.to_argv()
            elif (
                (spec := field.metadata.get(_FLAG))
                and not spec.secret
                and (spec.always or value != _default(field))
            ):
                argv += _render(option(field.name), value)
        return argv
