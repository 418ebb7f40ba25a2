"""The worker reads request entries through the typed wire protocol (lorafn.store.protocol): a malformed
or unknown entry is answered with an `invalid_request` error event and counted in the function's
`errors`, the worker keeps serving; a well-formed one is answered with protocol events end to end.

A real redis-server and a worker thread with the tests' fake engine; entries are written raw (XADD), as
a gateway of another version or a corrupted entry would."""

from __future__ import annotations

import time
import uuid

import pytest

from lorafn.store import Keys, Store, stats, streams
from lorafn.store.protocol import Accepted, Delta, Done, Error, ReplyEvent, RequestBody
from tests.integration.gateway.harness import expected_text, worker_thread

FN = "team-a/proto"


def _replies(store: Store, keys: Keys, rid: str, timeout: float = 10.0) -> list[ReplyEvent]:
    """The request's reply events, once the last one ended it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = [e for _, _, e in store.run(streams.read_replies(keys, rid, "0", None))]
        if events and isinstance(events[-1], Done | Error):
            return events
        time.sleep(0.02)
    raise AssertionError(f"no final reply event for {rid} within {timeout} s")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "body: missing"),
        ({"body": "not json"}, "body"),
        ({"body": '{"prompt": "hi", "temperature": 0}'}, "body.temperature"),  # unknown field
        ({"body": '{"prompt": "hi", "params": {"max_tokens": true}}'}, "body.params.max_tokens"),
        ({"body": '{"prompt": "hi", "params": {"top_p": 2.0}}'}, "body.params.top_p"),
        ({"body": "{}"}, "neither prompt nor prompt_token_ids"),
        ({"body": RequestBody(prompt="hi").encode(), "deadline": "soon"}, "deadline"),
    ],
    ids=["no-body", "not-json", "unknown-field", "wrong-type", "out-of-range", "no-prompt", "bad-deadline"],
)
def test_a_malformed_entry_is_refused_counted_and_the_worker_keeps_serving(
    redis_server: str, fields: dict[str, str], message: str
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    with worker_thread(redis_server, prefix, FN) as worker:
        store.client.xadd(keys.requests(FN), {"rid": "bad", **fields})
        (error,) = _replies(store, keys, "bad")
        assert isinstance(error, Error) and error.code == "invalid_request"
        assert message in error.message
        assert store.run(stats.counters(keys, FN)).get("errors") == 1

        good = RequestBody(prompt="hello").encode()
        store.client.xadd(keys.requests(FN), {"rid": "good", "body": good, "deadline": "0"})
        events = _replies(store, keys, "good")
        assert events[0] == Accepted(worker=worker.worker_id)
        text = "".join(e.text for e in events if isinstance(e, Delta))
        assert text == expected_text("hello", 8)
        assert events[-1] == Done(finish_reason="length", prompt_tokens=1, completion_tokens=8)
    assert store.run(stats.counters(keys, FN)).get("errors") == 1
    assert store.run(streams.pending(keys, FN, 0)) == []
