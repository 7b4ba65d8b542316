"""Request bodies as typed models: decoded and checked in one pass by msgspec (chosen by
measurement over pydantic and hand-written checks, bench/notes/scale.md), described in
/openapi.json (prism.gateway.openapi), and refused as PrismError naming the field as sent."""

from __future__ import annotations

import functools
import re
from typing import Any, TypeVar

import msgspec

from prism.rpc.errors import PrismError, invalid

T = TypeVar("T", bound=msgspec.Struct)

_REF = "#/components/schemas/{name}"


class Object(msgspec.Struct, omit_defaults=True):
    """A JSON object whose unknown keys are ignored (clients' SDKs add some:
    `cache_control`, `detail`...)."""


class Body(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A request body: an unknown parameter is refused by name."""


def openapi(kind: type[msgspec.Struct]) -> dict[str, Any]:
    """The OpenAPI operation's request body of `kind` (FastAPI's `openapi_extra`): a
    reference to its schema, which `components` holds."""
    schema = {"$ref": _REF.format(name=kind.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def components(kinds: list[type[msgspec.Struct]]) -> dict[str, Any]:
    """The JSON schema of each of `kinds` and of the models they hold."""
    _, schemas = msgspec.json.schema_components(kinds, ref_template=_REF)
    return schemas


@functools.cache
def _decoder(kind: type[T]) -> msgspec.json.Decoder[T]:
    return msgspec.json.Decoder(kind)


def decode(data: bytes, kind: type[T]) -> T:
    """The request body `data` as a `kind`, or PrismError naming the field at fault."""
    try:
        return _decoder(kind).decode(data)
    except msgspec.ValidationError as exc:
        if _UNKNOWN.match(str(exc)):
            # Rare: a null is "not given" for any key, known or not, as before typing.
            return typed(msgspec.json.decode(data), kind)
        raise refusal(exc) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None


def typed(body: Any, kind: type[T], strict: bool = True) -> T:
    """`body` (a decoded JSON value, or already a `kind`) as a `kind`; not `strict`, a
    number or boolean may come as a string."""
    if isinstance(body, kind):
        return body
    if isinstance(body, dict):
        body = {key: value for key, value in body.items() if value is not None}
    try:
        return msgspec.convert(body, kind, strict=strict)
    except msgspec.ValidationError as exc:
        raise refusal(exc) from None


_AT = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`")


def refusal(exc: msgspec.ValidationError) -> PrismError:
    """msgspec's error as OpenAI's: "`detail` - at `$.a[0].b`" names `a[0].b`; a missing
    field names itself; a bad item of a list of numbers or strings names its list."""
    match = _AT.match(str(exc))
    assert match is not None
    detail, path = match["detail"], (match["path"] or "").lstrip(".")
    unknown, missing = _UNKNOWN.match(detail), _MISSING.match(detail)
    if unknown:
        param = ".".join(p for p in (path, unknown["name"]) if p)
        return invalid(f"unsupported parameter '{param}'", param)
    if missing:
        param = ".".join(p for p in (path, missing["name"]) if p)
        return invalid(f"'{param}' is required", param)
    if not path:
        return invalid("request body must be a JSON object")
    if not detail.startswith("Expected `object`"):
        path = re.sub(r"\[\d+\]$", "", path)
    return invalid(f"'{path}': {detail}", path)
