"""/openapi.json with every request body's schema: FastAPI's document, with the components
that the endpoints' typed bodies (prism.gateway.bodies) refer to. (The endpoints
read their bodies themselves, in one pass, so FastAPI sees no body parameter to describe;
a file upload's form FastAPI describes itself.)"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from prism.gateway import bodies
from prism.gateway.anthropic import schemas as anthropic
from prism.gateway.batch import schemas as batch
from prism.gateway.openai import schemas as openai


def describe(app: FastAPI) -> None:
    """Makes `app`'s OpenAPI document hold the request bodies' schemas."""
    document = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            components = document().setdefault("components", {})
            kinds = [*openai.BODIES.values(), *anthropic.BODIES.values(), *batch.BODIES.values()]
            components.setdefault("schemas", {}).update(bodies.components(kinds))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
