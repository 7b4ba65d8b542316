"""/openapi.json with every request body's schema: FastAPI's document, with the components
that the endpoints' typed bodies (prism.gateway.openai.schemas) refer to. (The endpoints
read their bodies themselves, in one pass, so FastAPI sees no body parameter to describe.)"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from prism.gateway.openai import schemas


def describe(app: FastAPI) -> None:
    """Makes `app`'s OpenAPI document hold the request bodies' schemas."""
    document = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            components = document().setdefault("components", {})
            components.setdefault("schemas", {}).update(schemas.components())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
