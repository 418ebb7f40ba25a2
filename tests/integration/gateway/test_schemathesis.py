"""Property-based testing of the gateway against its own OpenAPI document (schemathesis + hypothesis):
generated requests, valid and invalid, with a valid key and without, over real HTTP: never a 5xx."""

from __future__ import annotations

import uuid
from pathlib import Path

import schemathesis
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from schemathesis.checks import not_a_server_error

from lorafn.gateway.routes import router
from lorafn.store import Keys, Store
from tests.integration.gateway.harness import FakeEngine, gateway, register, worker_thread

FN, KEY = "team-a/summarize", "sk-a-0123456789"
EXAMPLES_PER_OPERATION = 100  # ~40 s in all on 2 cores


def test_no_server_errors_for_generated_requests(redis_server: str, tiny_model_dir: Path) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY], model_dir=str(tiny_model_dir))
    with (
        gateway(redis_server, prefix, rate_limit_rps=0, queue_timeout_s=5) as url,
        worker_thread(redis_server, prefix, FN, engine=FakeEngine(max_output=4)),
    ):
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        operations = [op.ok() for op in schema.get_all_operations()]
        # every route of the app is exercised (a route added later is too)
        assert {op.label for op in operations} == {
            f"{method} {route.path}"
            for route in router.routes
            if isinstance(route, APIRoute)
            for method in route.methods
        }
        seen: dict[str, set[int]] = {}
        for operation in operations:
            _property(operation, url, seen)()
        # generated requests got past auth and validation to a worker on every invocation endpoint
        for label in (
            "POST /v1/completions",
            "POST /v1/chat/completions",
            "POST /v1/functions/{namespace}/{name}:invoke",
        ):
            assert 200 in seen[label], seen


def _property(operation, url: str, seen: dict[str, set[int]]):
    """A hypothesis test over one API operation: generated bodies and parameters, three kinds of key."""

    @given(
        case=operation.as_strategy(),
        key=hst.sampled_from([KEY, None, "sk-wrong"]),
        model=hst.sampled_from([FN, None]),
    )
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        # the same examples every run: random ones reached a worker on every invocation endpoint only
        # about 5 runs in 6 (the assertion below then failed at random)
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def check(case, key, model) -> None:
        if model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model  # reach past auth into validation and the worker
        if model and case.path_parameters and "namespace" in case.path_parameters:
            case.path_parameters = dict(zip(("namespace", "name"), model.split("/"), strict=True))
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = case.call_and_validate(
            base_url=url, headers=headers, checks=[not_a_server_error], timeout=30
        )
        seen.setdefault(operation.label, set()).add(response.status_code)

    return check
