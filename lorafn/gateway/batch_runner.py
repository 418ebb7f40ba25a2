"""The batch runner (docs/batch.md#how-a-batch-runs): the I/O driver around the pure packing policy
(`batch_packing`). It runs as an asyncio task in the gateway process, active in one gateway of the
deployment at a time (a Redis lease); why there and not in the controller:
docs/batch.md#where-the-runner-runs.

Each tick (`batch_tick_s`):
1. read the reply streams of every batch request in flight (one XREAD over all of them): text deltas,
   restarts (a worker died and another re-claimed the entry: its text starts over), done/error;
2. record each finished request once (`store.batches.record_outcome`, HSETNX under its custom_id), retry a
   request whose worker failed (a new request id, at most `batch_retries` times);
3. per function with pending batch work: pack the next wave into what its live workers' KV budgets and
   `batch_max_inflight_per_worker` leave free, and submit it at batch priority without deadline; with no
   live worker, record cold-start demand exactly as an online request does (and queue one wave);
   what is left unsubmitted per function is written as its backlog (`store.batches.set_backlog`), which the
   controller counts as demand for more workers (bound from the warm pool, up to maxReplicas);
4. cancel (`cancelling`) or expire (past `expires_at`) batches: stop submitting, cancel what runs,
   record the rest as cancelled; write the output and error files of finished batches.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from lorafn.gateway import batch_packing as packing
from lorafn.gateway.admission import Job
from lorafn.gateway.batch_files import FileStore, new_id
from lorafn.gateway.batch_routes import error_line
from lorafn.gateway.deps import Gateway
from lorafn.gateway.responses import completion_body
from lorafn.store import UNAVAILABLE_ERRORS, Op, streams, workers
from lorafn.store import batches as bs
from lorafn.store import registry as reg
from lorafn.store.cancel import cancel_request
from lorafn.store.protocol import (
    Accepted,
    Delta,
    Done,
    Error,
    ProtocolError,
    RequestBody,
    Restart,
    decode_events,
)

log = logging.getLogger("lorafn.gateway.batch")

# Errors a retry may cure (a worker died or failed); any other error is the request's own.
RETRYABLE = {"worker_failures", "data_plane_interrupted", "engine_error", "expired"}
KV_BLOCK_SIZE = 16  # lorafn.runtime.config.EngineConfig.block_size (the gateway imports no runtime)


@dataclass
class Prepared:
    custom_id: str
    line: int
    kind: str
    prompt_tokens: int
    body: RequestBody

    @property
    def item(self) -> packing.Item:
        return packing.Item(self.custom_id, self.prompt_tokens, self.body.params.max_tokens)


@dataclass
class Flight:
    """A submitted batch request whose answer is not recorded yet."""

    batch_id: str
    custom_id: str
    rid: str
    attempt: int
    size: int  # predicted KV tokens
    entry_id: str | None = None  # its request-stream entry (deleted on cancel, if no worker read it yet)
    cursor: str = "0"
    text: str = ""
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class BatchState:
    record: dict[str, str]
    requests: dict[str, Prepared]
    order: list[str]  # custom_ids in input order
    pending: list[str]  # not yet submitted, largest predicted first


class BatchMetrics:
    def __init__(self, registry: Any) -> None:
        self.batches = Gauge(
            "lorafn_batches", "batches the runner holds, by state", ["state"], registry=registry
        )
        self.finished = Counter(
            "lorafn_batches_finished", "batches ended, by final state", ["state"], registry=registry
        )
        self.requests = Counter(
            "lorafn_batch_requests",
            "batch requests recorded, by outcome (completed, failed, cancelled)",
            ["outcome"],
            registry=registry,
        )
        self.inflight = Gauge(
            "lorafn_batch_requests_inflight", "batch requests submitted, not answered", registry=registry
        )


def kv_bytes_per_token(model_dir: str) -> int | None:
    """K and V of every layer for one token, from the backbone's config.json (None when unreadable)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        dtype_bytes = 4 if str(cfg.get("torch_dtype", "float16")) == "float32" else 2
        return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes
    except (OSError, ValueError, KeyError, TypeError):
        return None


class BatchRunner:
    def __init__(self, gw: Gateway, holder: str | None = None) -> None:
        self.gw, self.keys, self.settings = gw, gw.keys, gw.settings
        self.files = FileStore(gw.settings.file_store_dir())
        self.holder = holder or f"gateway-{uuid.uuid4().hex[:12]}"
        self.states: dict[str, BatchState] = {}
        self.flights: dict[str, Flight] = {}  # request id -> flight
        self.observed: dict[str, collections.deque[int]] = {}  # function -> completion tokens seen
        self.metrics = BatchMetrics(gw.metrics.registry)
        self.leader = False
        self._per_token: dict[str, int | None] = {}
        self._attempts: dict[tuple[str, str], int] = {}  # (batch, custom_id) -> last attempt submitted
        self._backlog_written = False

    # -- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except UNAVAILABLE_ERRORS as e:
                log.warning("batch runner: Redis unavailable (%s)", e.__class__.__name__)
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("batch runner: tick failed")
                await asyncio.sleep(1.0)

    async def release(self) -> None:
        """On shutdown: hand the lease over at once (what is in flight is in Redis; the next runner reads
        the same reply streams)."""
        if self.leader:
            with contextlib.suppress(*UNAVAILABLE_ERRORS):
                await self.gw.store.run(bs.release_runner_lease(self.keys, self.holder))
            self.leader = False

    def _lease_ms(self) -> int:
        """The runner lease's expiry (and the backlog's): ten ticks, at least 5 s."""
        return int(max(5.0, 10 * self.settings.batch_tick_s) * 1000)

    async def tick(self) -> None:
        s = self.settings
        ttl_ms = self._lease_ms()
        leader = await self.gw.store.run(bs.acquire_runner_lease(self.keys, self.holder, ttl_ms))
        if not leader:
            if self.leader:  # lost the lease: forget everything (the new holder reads it from Redis)
                self.states.clear()
                self.flights.clear()
            self.leader = False
            await asyncio.sleep(s.batch_tick_s)
            return
        self.leader = True
        active = await self.gw.store.run(bs.active_batch_ids(self.keys))
        for batch_id in [b for b in self.states if b not in active]:
            self._forget(batch_id)
        for batch_id in active:
            if batch_id not in self.states:
                await self._load(batch_id)
        if self.flights:
            # Read replies for up to a tick, but go on to pack at once when a request ends (its slot and
            # KV are free). Packing after every read instead ran the whole submit path (several round
            # trips) per decode step of the workers: on a 2-core CPU it took the cores the workers needed.
            deadline, running = time.monotonic() + s.batch_tick_s, len(self.flights)
            while self.flights and len(self.flights) == running:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms < 1:
                    break
                await self._read_replies(block_ms=left_ms)
        else:
            await asyncio.sleep(s.batch_tick_s)
        await self._advance()

    # -- loading a batch (a new one, or one a previous runner left) -------------------------------
    async def _load(self, batch_id: str) -> None:
        rec = await self.gw.store.run(bs.get_batch(self.keys, batch_id))
        if not rec:
            return
        requests: dict[str, Prepared] = {}
        order: list[str] = []
        try:
            text = await asyncio.to_thread(self.files.read, rec.get("requests_path", ""))
        except OSError as e:
            # the file store lost them (an emptyDir of another pod, a deleted directory): the batch fails
            log.error("batch %s: its prepared requests %s are unreadable", batch_id, rec.get("requests_path"))
            why = [{"code": "requests_unreadable", "message": f"the prepared requests are unreadable: {e}"}]
            now = int(time.time())
            await self.gw.store.run(
                bs.finish_batch(
                    self.keys, batch_id, {"status": bs.FAILED, "failed_at": now, "errors": json.dumps(why)}
                )
            )
            self.metrics.finished.labels(bs.FAILED).inc()
            return
        for raw in text.decode().splitlines():
            obj = json.loads(raw)
            p = Prepared(
                obj["custom_id"],
                int(obj["line"]),
                obj["kind"],
                int(obj["prompt_tokens"]),
                RequestBody.model_validate(obj["body"], strict=False),
            )
            requests[p.custom_id] = p
            order.append(p.custom_id)
        answered, failed, inflight = await self.gw.store.run(bs.progress(self.keys, batch_id))
        function = rec.get("function", "")
        for custom_id, value in inflight.items():  # left by a previous runner: read its replies again
            rid, _, attempt = value.partition("|")
            if custom_id in requests and custom_id not in answered | failed:
                self.flights[rid] = Flight(
                    batch_id, custom_id, rid, int(attempt or 0), self._size(function, requests[custom_id])
                )
        running = {f.custom_id for f in self.flights.values() if f.batch_id == batch_id}
        todo = [c for c in order if c not in answered and c not in failed and c not in running]
        sizes = {c: self._size(function, requests[c]) for c in todo}
        pending = [it.key for it in packing.order_for_packing([requests[c].item for c in todo], sizes)]
        self.states[batch_id] = BatchState(rec, requests, order, pending)

    def _forget(self, batch_id: str) -> None:
        self.states.pop(batch_id, None)
        for key in [k for k in self._attempts if k[0] == batch_id]:
            del self._attempts[key]
        for rid in [r for r, f in self.flights.items() if f.batch_id == batch_id]:
            del self.flights[rid]

    def _size(self, function: str, p: Prepared) -> int:
        return packing.predicted_tokens(p.item, self._estimate(function), KV_BLOCK_SIZE)

    def _estimate(self, function: str) -> int | None:
        return packing.output_estimate(self.observed.get(function, ()))

    # -- replies --------------------------------------------------------------------------------
    async def _read_replies(self, block_ms: int) -> None:
        flights = list(self.flights.values())
        cursors = {self.keys.reply(f.rid): f.cursor for f in flights}
        by_key = {self.keys.reply(f.rid): f for f in flights}
        op: Op[Any] = Op(lambda pipe: pipe.xread(cursors, count=256, block=block_ms), lambda r: r[0])
        reply = await self.gw.store.run(op)
        if not reply:
            return
        for name, entries in reply.items() if isinstance(reply, dict) else reply:
            flight = by_key.get(name)
            if flight is None:
                continue
            if (
                entries
                and isinstance(entries[0], list)
                and entries[0]
                and isinstance(entries[0][0], list | tuple)
            ):
                entries = entries[0]  # RESP3 wraps the entry list once more (streams.stream_entries)
            for entry_id, fields in entries:
                flight.cursor = entry_id
                try:
                    events = decode_events((fields or {}).get("e"))
                except ProtocolError as e:
                    await self._finish(flight, None, Error(code="protocol_error", message=str(e)))
                    break
                ended = False
                for event in events:
                    if isinstance(event, Restart):
                        flight.text = ""  # another worker starts it over: the text so far is void
                    elif isinstance(event, Delta):
                        flight.text += event.text
                    elif isinstance(event, Done | Error):
                        await self._finish(
                            flight,
                            event if isinstance(event, Done) else None,
                            event if isinstance(event, Error) else None,
                        )
                        ended = True
                        break
                    elif isinstance(event, Accepted):
                        pass
                if ended:
                    break

    async def _finish(self, flight: Flight, done: Done | None, error: Error | None) -> None:
        self.flights.pop(flight.rid, None)
        state = self.states.get(flight.batch_id)
        if state is None:
            return
        function = state.record.get("function", "")
        prepared = state.requests[flight.custom_id]
        if done is not None and done.finish_reason == "abort":
            error = Error(code="batch_cancelled", message="the batch was cancelled while this request ran")
            done = None
        if done is not None:
            self.observed.setdefault(function, collections.deque(maxlen=512)).append(done.completion_tokens)
            job = Job(function, flight.rid, "", False, prepared.prompt_tokens, flight.submitted)
            body = completion_body(
                job, flight.text, done, "chat" if prepared.kind == "chat" else "completion", time.monotonic()
            )
            line = json.dumps(
                {
                    "id": f"batch_req_{flight.rid}",
                    "custom_id": flight.custom_id,
                    "response": {"status_code": 200, "request_id": flight.rid, "body": body},
                    "error": None,
                },
                separators=(",", ":"),
            )
            if await self.gw.store.run(
                bs.record_outcome(self.keys, flight.batch_id, flight.custom_id, line, "completed")
            ):
                self.metrics.requests.labels("completed").inc()
            return
        assert error is not None
        if (
            error.code in RETRYABLE
            and flight.attempt < self.settings.batch_retries
            and state.record.get("status") == bs.IN_PROGRESS
        ):
            state.pending.insert(0, flight.custom_id)  # resubmitted first, under a new request id
            return
        line = error_line(flight.custom_id, error.code, error.message)
        if await self.gw.store.run(
            bs.record_outcome(self.keys, flight.batch_id, flight.custom_id, line, "failed")
        ):
            self.metrics.requests.labels("failed").inc()

    # -- submitting, cancelling, finishing ------------------------------------------------------
    async def _advance(self) -> None:
        now = time.time()
        by_function: dict[str, list[str]] = {}
        active_now: set[str] = set()  # in progress, with requests left to submit
        for batch_id, state in list(self.states.items()):
            rec = await self.gw.store.run(bs.get_batch(self.keys, batch_id))
            if not rec:
                self._forget(batch_id)
                continue
            state.record = rec
            status = rec.get("status")
            if status == bs.IN_PROGRESS and float(rec.get("expires_at") or math.inf) < now:
                status = bs.EXPIRED
            if status in (bs.CANCELLING, bs.EXPIRED):
                await self._stop(batch_id, state, status)
                continue
            running = any(f.batch_id == batch_id for f in self.flights.values())
            if not state.pending and not running:
                await self._write_files(batch_id, state, bs.COMPLETED)
                continue
            if state.pending:
                by_function.setdefault(rec.get("function", ""), []).append(batch_id)
                active_now.add(batch_id)
        for function, batch_ids in by_function.items():
            await self._submit(function, batch_ids)
        # what is left unsubmitted is demand the controller sees (more workers from the warm pool, up to
        # maxReplicas; they go back by keep-alive once the backlog is gone); it expires with the lease
        backlog: collections.Counter[str] = collections.Counter()
        for batch_id, state in self.states.items():
            if batch_id in active_now:
                backlog[state.record.get("function", "")] += len(state.pending)
        if backlog or self._backlog_written:  # an idle runner writes nothing
            await self.gw.store.run(bs.set_backlog(self.keys, dict(backlog), self._lease_ms()))
            self._backlog_written = bool(backlog)
        counts = collections.Counter(s.record.get("status", "") for s in self.states.values())
        for state in bs.STATES:
            self.metrics.batches.labels(state).set(counts.get(state, 0))
        self.metrics.inflight.set(len(self.flights))

    async def _capacity(self, function: str) -> tuple[int, int | None]:
        """(live workers, the KV tokens batch waves may be packed into, or None when no figure is known):
        their KV budgets, plus `batch_kv_overcommit` of that within their host KV budgets."""
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        now_ms = await self.gw.store.run(workers.server_time_ms())
        live = await self.gw.store.run(workers.live_workers(self.keys, function, ttl_ms, now_ms))
        if not live:
            return 0, None
        info = await self.gw.store.run(workers.worker_info(self.keys, live))
        if function not in self._per_token:
            record = await self.gw.store.run(reg.get_function(self.keys, function))
            self._per_token[function] = (
                kv_bytes_per_token(record.model_dir) if record and record.model_dir else None
            )
        per_token = self._per_token[function]
        kv = [int(h.get("kv_bytes") or 0) for h in info.values()]
        if per_token is None or not all(kv):
            return len(live), None
        host = sum(int(h.get("kv_host_budget_bytes") or 0) // per_token for h in info.values())
        kv_tokens = sum(b // per_token for b in kv)
        return len(live), packing.packing_room(kv_tokens, host, self.settings.batch_kv_overcommit)

    async def _submit(self, function: str, batch_ids: list[str]) -> None:
        s = self.settings
        live, kv_tokens = await self._capacity(function)
        mine = [
            f for f in self.flights.values() if self.states[f.batch_id].record.get("function") == function
        ]
        slots = max(1, live) * s.batch_max_inflight_per_worker - len(mine)
        free_tokens = None if kv_tokens is None else kv_tokens - sum(f.size for f in mine)
        if live == 0:
            # a cold start, recorded as an online request records it (guarded: at most one per period)
            await self.gw.store.run(streams.record_demand(self.keys, function, "batch", s.demand_guard_ms))
        for batch_id in batch_ids:  # oldest batch first (ids are random: order by creation)
            state = self.states[batch_id]
            if slots < 1:
                break
            sizes = {c: self._size(function, state.requests[c]) for c in state.pending}
            items = [state.requests[c].item for c in state.pending]
            wave = packing.next_wave(items, sizes, free_tokens, slots, nothing_in_flight=not mine)
            if not wave:
                continue
            chosen = {it.key for it in wave}
            state.pending = [c for c in state.pending if c not in chosen]
            batch: list[tuple[str, str, RequestBody, int]] = []
            for it in wave:
                attempt = self._attempts.get((batch_id, it.key), -1) + 1
                self._attempts[(batch_id, it.key)] = attempt
                rid = f"b{secrets.token_hex(12)}"
                batch.append((it.key, rid, state.requests[it.key].body, attempt))
                self.flights[rid] = Flight(batch_id, it.key, rid, attempt, sizes[it.key])
            entry_ids = await self.gw.store.run(bs.submit(self.keys, function, batch_id, batch))
            for (_c, rid, _b, _a), entry_id in zip(batch, entry_ids, strict=False):
                self.flights[rid].entry_id = entry_id
            slots -= len(wave)
            if free_tokens is not None:
                free_tokens -= sum(sizes[it.key] for it in wave)
            mine = mine + [self.flights[r] for _c, r, _b, _a in batch]

    async def _stop(self, batch_id: str, state: BatchState, status: str) -> None:
        """Cancel or expire: no more submissions; cancel what runs; the rest becomes error lines."""
        function = state.record.get("function", "")
        code, why = (
            ("batch_cancelled", "the batch was cancelled before this request ran")
            if status == bs.CANCELLING
            else ("batch_expired", "the batch's completion window ended before this request ran")
        )
        for flight in [f for f in self.flights.values() if f.batch_id == batch_id]:
            await self.gw.store.run(cancel_request(self.keys, function, flight.rid, flight.entry_id))
            del self.flights[flight.rid]
            state.pending.append(flight.custom_id)
        for custom_id in state.pending:
            line = error_line(custom_id, code, why)
            if await self.gw.store.run(bs.record_outcome(self.keys, batch_id, custom_id, line, "cancelled")):
                self.metrics.requests.labels("cancelled").inc()
        state.pending = []
        await self._write_files(batch_id, state, bs.CANCELLED if status == bs.CANCELLING else bs.EXPIRED)

    async def _write_files(self, batch_id: str, state: BatchState, status: str) -> None:
        """Write the output and error files from the recorded lines (input order) and end the batch."""
        now = int(time.time())
        await self.gw.store.run(
            bs.update_batch(self.keys, batch_id, {"status": bs.FINALIZING, "finalizing_at": now})
        )
        results, errors = await self.gw.store.run(bs.outcome_lines(self.keys, batch_id))
        function = state.record.get("function", "")
        out = [results[c] for c in state.order if c in results]
        numbered = sorted(errors.items(), key=lambda kv: _error_order(kv[0], state))
        err = [line for _k, line in numbered]
        fields: dict[str, Any] = {"status": status, f"{status}_at": now}
        for kind, lines in (("output", out), ("error", err)):
            if not lines:
                continue
            file_id = new_id("file-")
            data = ("\n".join(lines) + "\n").encode()
            path = await asyncio.to_thread(self.files.write, file_id, data)
            rec = {
                "purpose": "batch_output",
                "filename": f"{batch_id}_{kind}.jsonl",
                "bytes": len(data),
                "created_at": now,
                "path": str(path),
            }
            await self.gw.store.run(bs.put_file(self.keys, function, file_id, rec))
            fields[f"{kind}_file_id"] = file_id
        await self.gw.store.run(bs.finish_batch(self.keys, batch_id, fields))
        self.metrics.finished.labels(status).inc()
        log.info("batch %s %s: %d answered, %d error lines", batch_id, status, len(out), len(err))
        self._forget(batch_id)


def _error_order(key: str, state: BatchState) -> tuple[int, str]:
    """Error lines in input order: `#<line>` keys carry their line, custom_ids their request's line."""
    if key.startswith("#") and key[1:].isdigit():
        return int(key[1:]), key
    p = state.requests.get(key)
    return (p.line if p else 1 << 30), key
