"""The reply relay: a request's reply stream (written by the worker, docs/gateway.md#stream-protocol)
turned into text deltas and a final `Done`, with timeouts, restarts and cancellation.

- `Relay.events`: the typed reply events (`lorafn.store.protocol`) of one job until `Done` or `Error`;
  no worker in time -> 503 `no_worker` (and demand again), the function's workers fail to start (a
  broken adapter) -> 503 `function_start_failed` with the reason at once (`start_failure`), too long ->
  504, an entry that does not parse -> 502 `invalid_reply`. After a `Restart` only its writer's events
  count.
- `Relay.texts`: events -> (text, None) ... ("", Done); a restart voids text given out before
  (docs/gateway.md#failure-behaviour).
- `Relay.cancel`: the request's client went away (or the gateway gave up on it): stop it at the worker.

Errors are raised as `APIError` and counted once, where they are answered (the app's error handler, or
the SSE stream's error event).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, suppress

import anyio

from lorafn.gateway.admission import Job
from lorafn.gateway.errors import APIError, bad_request, unavailable
from lorafn.gateway.metrics import Metrics
from lorafn.gateway.settings import GatewaySettings
from lorafn.store import UNAVAILABLE_ERRORS, AsyncStore, Keys, cancel, combine, control, streams, workers
from lorafn.store.protocol import Accepted, Delta, Done, Error, ProtocolError, ReplyEvent, Restart

log = logging.getLogger("lorafn.gateway")

# how often a non-streamed request checks whether its client is still there
DISCONNECT_POLL_S = 0.2

# a request's stage marks (Job.marks), in the order they happen
# (`reading`: the relay's first read of the reply stream was sent; `replied`: the first read that returned
# events came back: with `accepted` they tell a stalled gateway from a late worker)
MARKS = (
    "authorized",
    "prepared",
    "enqueued",
    "reading",
    "replied",
    "accepted",
    "first_delta",
    "first_text",
    "done",
)
# the histogram's phases: (name, from mark, to mark)
PHASES = (
    ("admission", "received", "enqueued"),
    ("accept", "enqueued", "accepted"),
    ("first_delta", "accepted", "first_delta"),
)


def client_gone() -> APIError:
    return APIError(
        499, "the client closed the connection", type="invalid_request_error", code="client_closed"
    )


# a function whose starts failed this many times in a row fails fast even when the last failure came
# before the request (the controller is backing off: no worker is coming soon)
FAIL_FAST_AFTER = 3


def start_failure(
    status: dict[str, str], submitted_at_ms: int, fail_fast_after: int = FAIL_FAST_AFTER
) -> str | None:
    """Why no worker is coming for a request that waits with no live worker, or None to keep waiting.

    `status` is the function's status hash, written by the controller (`lorafn.store.control`):
    `problem` (the controller cannot plan a worker at all until the function changes, e.g. its adapter
    no longer reads), `start_failures` (failed starts in a row, 0 after a worker bound), `last_failure`
    (the loader's or the process's reason), `last_failure_at_ms` (unix ms). A start that failed after the
    request was submitted was the one made for it; `fail_fast_after` failures in a row mean the
    controller backs off and a retry within the request's wait is unlikely. Pure.
    """
    if status.get("problem"):
        return status["problem"]
    try:
        failures = int(status.get("start_failures") or 0)
        failed_at = int(status.get("last_failure_at_ms") or 0)
    except ValueError:
        return None
    reason = status.get("last_failure", "")
    if failures <= 0 or not reason:
        return None
    if failed_at < submitted_at_ms and failures < fail_fast_after:
        return None
    plural = "s" if failures != 1 else ""
    return f"{reason} ({failures} failed start{plural} in a row)"


def redis_unavailable() -> APIError:
    return unavailable("the data plane (Redis) is unreachable; retry shortly", code="redis_unavailable")


class Relay:
    """Reads reply streams for the routes; one per gateway app."""

    def __init__(self, settings: GatewaySettings, store: AsyncStore, keys: Keys, metrics: Metrics) -> None:
        self.settings, self.store, self.keys, self.metrics = settings, store, keys, metrics

    async def events(self, job: Job) -> AsyncIterator[ReplyEvent]:
        """The request's reply events until `Done` or `Error`; timeouts become APIError."""
        s = self.settings
        last = "0"
        accepted = False
        owner: str | None = None  # the worker whose events count, once a restart named one
        accept_by = job.t0 + (s.cold_start_timeout_s if job.cold else s.queue_timeout_s)
        extended = job.cold  # a warm request becomes a cold start when its workers are gone
        end_by = job.t0 + s.request_timeout_s
        ttl_ms = int(s.heartbeat_ttl_s * 1000)
        next_poll = job.t0
        while True:
            now = time.monotonic()
            if job.disconnected is not None and now >= next_poll:
                if await job.disconnected():
                    raise client_gone()
                next_poll = now + DISCONNECT_POLL_S
            if not accepted and now > accept_by:
                # The controller says why no worker serves the function (e.g. no GPU memory fits it).
                status = await self.store.run(control.statuses(self.keys, [job.function]))
                why = status[job.function].get("wait_reason", "")
                raise unavailable(
                    f"no worker of function {job.function!r} took the request within "
                    f"{accept_by - job.t0:.0f} s"
                    + (f": {why}" if why else " (cold start did not complete)" if job.cold else ""),
                    code="no_worker",
                    retry_after_s=5,
                )
            if now > end_by:
                raise APIError(
                    504,
                    f"the request did not finish within {s.request_timeout_s:.0f} s",
                    type="timeout_error",
                    code="request_timeout",
                )
            block = int(max(1, min(1000, (min(end_by, accept_by if not accepted else end_by) - now) * 1000)))
            if job.disconnected is not None:
                block = min(block, int(DISCONNECT_POLL_S * 1000))
            job.marks.setdefault("reading", time.monotonic())
            try:
                batch = await self.store.run(streams.read_replies(self.keys, job.request_id, last, block))
            except ProtocolError as e:
                raise self._invalid_reply(job, e) from None
            if batch:
                job.marks.setdefault("replied", time.monotonic())
            if not batch:
                # nobody answered for a while: is anyone left to? If not, ask for a worker (again), unless
                # the function's workers keep failing to start: then say why at once (issue 15).
                live, status = await self.store.run(
                    combine(
                        workers.count_live_workers(self.keys, job.function, ttl_ms),
                        control.statuses(self.keys, [job.function]),
                    )
                )
                failed = start_failure(status[job.function], job.submitted_at_ms) if live == 0 else None
                if failed is not None and not accepted:
                    raise unavailable(
                        f"function {job.function!r} cannot start a worker: {failed}; fix the function "
                        "(e.g. its adapter) and apply it again",
                        code="function_start_failed",
                        retry_after_s=10,
                    )
                if live == 0:
                    await self.store.run(
                        streams.record_demand(self.keys, job.function, "waiting", s.demand_guard_ms)
                    )
                    if not accepted and not extended:
                        # the live worker of admission died (noticed after heartbeat_ttl_s): the request
                        # now waits for a cold start (or a claim by the next worker), so give it that long
                        extended = True
                        accept_by = max(accept_by, time.monotonic() + s.cold_start_timeout_s)
                continue
            for entry_id, writer, event in batch:
                last = entry_id
                if isinstance(event, Restart):
                    # another worker took the request over: from now on only its events count (a
                    # presumed-dead worker that still writes is ignored)
                    owner = writer
                    job.restarts += 1
                    self.metrics.restarts.labels(self.metrics.function(job.function)).inc()
                elif owner is not None and writer != owner:
                    continue
                if isinstance(event, Accepted):
                    accepted = True
                    job.marks.setdefault("accepted", time.monotonic())
                elif isinstance(event, Delta) and event.tokens:
                    job.marks.setdefault("first_delta", time.monotonic())
                yield event
                if isinstance(event, Done | Error):
                    return

    async def texts(self, job: Job, streaming: bool) -> AsyncGenerator[tuple[str | None, Done | None], None]:
        """(text delta, None) ... then ("", the Done event), restarts handled (see docs/gateway.md).

        Not streaming: a restart yields (None, None): the caller drops the text it collected.
        Streaming: after a restart the new text is held back until it passes what was already given
        out; if it reproduces that text (greedy, or the same seed) the relay continues seamlessly, else
        it ends with a `restart_diverged` error.
        """
        sent = ""  # text given to the caller
        replay: str | None = None  # text of the restarted attempt, while it is still behind `sent`
        ended = False  # the worker ended the request (done/error): nothing to clean up
        outcome = "gone"  # for the request's log line: the finish reason, or the error's code
        try:
            async for event in self.events(job):
                if isinstance(event, Restart) and not streaming:
                    sent = ""
                    yield None, None
                elif isinstance(event, Restart):
                    replay = "" if sent else None
                elif isinstance(event, Delta):
                    text = event.text
                    if replay is None:
                        if text:
                            if job.first_text_at is None:
                                job.first_text_at = job.marks["first_text"] = time.monotonic()
                                self.metrics.ttft.labels(self.metrics.function(job.function)).observe(
                                    job.first_text_at - job.t0
                                )
                            sent += text
                            yield text, None
                        continue
                    replay += text
                    if len(replay) <= len(sent):
                        if not sent.startswith(replay):
                            raise self._diverged()
                        continue
                    if not replay.startswith(sent):
                        raise self._diverged()
                    rest, replay = replay[len(sent) :], None
                    sent += rest
                    yield rest, None
                elif isinstance(event, Done):
                    ended = True
                    outcome = event.finish_reason
                    if replay is not None and replay != sent:
                        outcome = "restart_diverged"
                        raise self._diverged()
                    job.marks["done"] = time.monotonic()
                    yield "", event
                    return
                elif isinstance(event, Error):
                    ended = True
                    outcome = event.code
                    raise self._worker_error(event)
        except UNAVAILABLE_ERRORS:
            outcome = "redis_unavailable"
            raise redis_unavailable() from None
        except APIError as e:
            outcome = e.code or str(e.status)
            raise
        finally:
            self.finished(job, outcome)
            if not ended:  # the client went away, a timeout, a divergence: drop the entry and replies
                await self.cancel(job)

    def finished(self, job: Job, outcome: str) -> None:
        """The request's stage times: a log line (key=value, ms since it was received; benchmarks parse
        it) and the phase histograms. Only for requests that came through the routes (`received`)."""
        marks = job.marks
        received = marks.get("received")
        if received is None:
            return
        start = "cold" if job.cold else "warm"
        for phase, begin, end in PHASES:
            if begin in marks and end in marks:
                self.metrics.phases.labels(phase, start).observe(max(0.0, marks[end] - marks[begin]))
        if not self.settings.request_log:
            return
        stages = " ".join(
            f"{name}_ms={(marks[name] - received) * 1000:.1f}" for name in MARKS if name in marks
        )
        log.info(
            "request rid=%s function=%s start=%s outcome=%s %s restarts=%d",
            job.request_id, job.function, start, outcome, stages, job.restarts,
        )  # fmt: skip

    async def collect(self, job: Job) -> tuple[str, Done]:
        """The whole answer of a non-streamed request and its `Done` event."""
        parts: list[str] = []
        async with aclosing(self.texts(job, streaming=False)) as texts:
            async for text, done in texts:
                if done is not None:
                    return "".join(parts), done
                if text is None:
                    parts.clear()
                else:
                    parts.append(text)
        raise APIError(500, "the reply stream ended without a result", type="server_error", code="no_result")

    async def cancel(self, job: Job) -> None:
        """Stop a request nobody waits for any more (its client went away, a timeout, a divergence): drop
        its entry (if not yet taken) and its reply stream, and flag it cancelled so that the worker running
        it aborts it (docs/gateway.md#failure-behaviour). Shielded: it runs while the relay is cancelled."""
        ttl_ms = int(max(60.0, self.settings.request_timeout_s) * 1000)
        with anyio.CancelScope(shield=True), suppress(UNAVAILABLE_ERRORS):
            await self.store.run(
                cancel.cancel_request(self.keys, job.function, job.request_id, job.entry_id, ttl_ms)
            )

    def _worker_error(self, event: Error) -> APIError:
        if event.code == "invalid_request":
            return bad_request(event.message, None, code=event.code)
        if event.code == "engine_error":
            return APIError(500, event.message, type="server_error", code=event.code)
        return unavailable(event.message, code=event.code)

    def _invalid_reply(self, job: Job, error: ProtocolError) -> APIError:
        # a worker of another version, or a corrupted entry: the worker's fault, not the client's
        log.warning("request %s of %s: unreadable reply entry (%s)", job.request_id, job.function, error)
        return APIError(
            502,
            f"the worker sent a reply the gateway cannot read ({error})",
            type="server_error",
            code="invalid_reply",
        )

    def _diverged(self) -> APIError:
        return unavailable(
            "the worker serving this request died after part of the answer was sent, and the "
            "retried answer differs; retry the request",
            code="restart_diverged",
        )
