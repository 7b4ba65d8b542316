"""/openapi.json: a valid OpenAPI 3 document in which every endpoint that takes a body
has that body's schema, and the schemas say what the endpoints refuse. Nothing is
started: the app's router finds no processor."""

from __future__ import annotations

import jsonschema
import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import validate

from prism.gateway import bodies
from prism.gateway.anthropic import schemas as anthropic
from prism.gateway.app import create_app
from prism.gateway.batch import schemas as batch
from prism.gateway.openai import schemas
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc.errors import PrismError


def _document() -> dict:
    with TestClient(create_app(Router(StaticRegistry({})))) as client:
        return client.get("/openapi.json").json()


def test_the_document_is_openapi_3_with_a_body_schema_for_every_post():
    document = _document()
    validate(document)
    posts = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    # Cancelling a stored response or a batch takes no body; a file comes as a form.
    takes_body = {path for path in posts if not path.endswith("/cancel")} - {"/v1/files"}
    form = posts["/v1/files"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["file", "purpose"]
    bodies = {**schemas.BODIES, **anthropic.BODIES, **batch.BODIES}
    assert takes_body == set(bodies)
    for path in takes_body:
        body = posts[path]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        assert name == bodies[path].__name__
        assert name in document["components"]["schemas"]


def _validator(document: dict, name: str) -> jsonschema.Draft202012Validator:
    # The document's schemas are JSON Schema 2020-12 (OpenAPI 3.1), with local references.
    schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


def test_the_schemas_refuse_what_the_endpoints_refuse():
    chat = _validator(_document(), "ChatCompletionRequest")
    good = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look."},
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}}]}]}  # fmt: skip
    assert chat.is_valid(good)
    for bad in ({**good, "temperature": 5}, {**good, "messages": []}, {**good, "frob": 1},
                {"messages": good["messages"]}):  # fmt: skip
        assert not chat.is_valid(bad), bad
        with pytest.raises(PrismError) as refused:
            bodies.typed(bad, schemas.ChatCompletionRequest)
        assert refused.value.http_status == 400
