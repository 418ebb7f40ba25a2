"""The route table: every route has its own metrics label, and the OpenAPI document describes the body
of every invocation route (they read their bodies by hand, so FastAPI does not see them)."""

from __future__ import annotations

from fastapi.routing import APIRoute

from lorafn.gateway.app import create_app
from lorafn.gateway.metrics import endpoint_of
from lorafn.gateway.routes import router
from lorafn.gateway.settings import GatewaySettings

INVOCATIONS = {"/v1/completions", "/v1/chat/completions", "/v1/functions/{namespace}/{name}:invoke"}


def _paths() -> set[str]:
    return {route.path for route in router.routes if isinstance(route, APIRoute)}


def test_every_route_has_a_metrics_label() -> None:
    labels = {path: endpoint_of(path.replace("{namespace}", "a").replace("{name}", "b")) for path in _paths()}
    assert "other" not in labels.values(), labels
    assert len(set(labels.values())) == len(labels), labels  # one label per route
    assert endpoint_of("/openapi.json") == "openapi"


def test_openapi_document_has_every_invocation_body() -> None:
    doc = create_app(GatewaySettings()).openapi()
    assert set(doc["paths"]) >= INVOCATIONS
    assert set(doc["paths"]) == _paths()
    for path in INVOCATIONS:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        name = ref.removeprefix("#/components/schemas/")
        assert "properties" in doc["components"]["schemas"][name], name
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
