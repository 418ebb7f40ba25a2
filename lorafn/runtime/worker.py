"""The worker: one process bound to one function, between its Redis streams and an Engine.

`lorafn worker serve` (the `app` below, configured by `WorkerSettings`) builds the engine and runs
`Worker`, the serving loop. (Longer than our ~450-line guide on purpose: the structure issue asked for
the worker in one place — loop, settings and entry point — so a newcomer finds it in one hop; the
standby part lives in `standby.py`.)

Per iteration (one round trip to Redis while the batch runs):
  engine.step() -> token deltas (on CUDA the previous step's: the engine queues a step before it reads
  the one before back, `EngineConfig.overlap_steps`, so this round trip runs while the GPU computes) ->
  XADD to each reply stream, XACK+XDEL finished entries, and a non-blocking XREADGROUP for new entries
  (up to the free batch slots) and an MGET of the cancel flags of the running requests — all in one
  pipeline. A request whose client went away (flagged by the gateway, see `lorafn.store.cancel`) is
  aborted in the engine before the next step and ends with a `done` event whose finish_reason is "abort"
  (stats counter `cancelled`); one still queued was deleted by the gateway and is never read.
When the batch is empty the worker blocks in XREADGROUP (`block_ms`, at most `control_poll_ms`), so a new
request wakes it at once; the same round trip reads its control stream.
Entries and reply events follow the typed wire protocol (`lorafn.store.protocol`): an entry whose body
does not parse as a `RequestBody` ends with an `invalid_request` error event (stats counter `errors`).

Around it:
- heartbeats (worker registry, expiring) every `heartbeat_s` from a thread of their own, so that a long
  engine step does not make the worker look dead; the control stream (`stop`/`drain`) is read as often;
- every `claim_interval_s`, entries pending for at least `claim_min_idle_ms` whose holder has no live
  heartbeat are claimed (XCLAIM: of two claimers one wins) and restarted from scratch: the reply
  stream gets a `restart` event first, so the gateway voids text it has not yet relayed and, for a
  stream already sent to a client, either continues (the retry reproduced the sent text) or ends it
  with an explicit error. An entry delivered more than `max_deliveries` times ends with an error
  (a request that kills its workers must not kill them all);
- SIGTERM (or a `drain`/`stop` command): stop reading, finish the running requests, ack, exit 0;
- `keep_alive_s` without work: exit 0 (a bound worker never goes back to the pool);
- `park` / `unpark` commands (docs/runtime.md#parking): an idle worker's engine releases its KV cache and
  decode graphs and the loop reads no requests until `unpark`, recording demand when its function's requests
  queue up; answered with `parked` / `park_refused` / `unparked` lifecycle events;
- Redis unreachable: abort the running requests (their clients already got an error from the gateway),
  retry with backoff, and on return drop what this worker still held with an error event.

The engine is `lorafn.runtime.Engine`, spoken to through its own interface (`ServingEngine`: add_request
with the request id, step -> `StreamDelta`s, abort, has_unfinished); tests and the gateway benchmark plug
in fakes of that interface through `WorkerSettings.engine_factory`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import redis
import typer
from pydantic import Field

from lorafn.api.settings import SharedSettings, TokenBuckets, token_buckets
from lorafn.runtime.batching import Batching, BatchingConfig, gpu_model_name
from lorafn.runtime.outputs import ParkRefused, StreamDelta
from lorafn.runtime.read_cap import DEFAULT_EXPECTED_TOKENS, ExpectedTokens, held_cap
from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.step_profile import StepProfiler
from lorafn.store import UNAVAILABLE_ERRORS, Keys, Op, Store, cancel, combine, control, streams, workers
from lorafn.store import stats as store_stats
from lorafn.store.protocol import Accepted, Delta, Done, Error, ReplyEvent, RequestBody, Restart
from lorafn.store.streams import entry_ms

log = logging.getLogger("lorafn.worker")
# how long a worker's first heartbeat waits for its serving loop's first read (see Worker._heartbeats)
FIRST_BEAT_WAIT_S = 0.25


class ServingEngine(Protocol):
    """The `lorafn.runtime.Engine` methods the loop uses (continuous batching: add while others run,
    step, abort). A finished `StreamDelta` carries the request's token counts."""

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str: ...

    def step(self) -> Sequence[StreamDelta]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...


@dataclass
class ServingConfig:
    function: str
    worker_id: str = field(default_factory=lambda: default_worker_id())
    max_running: int = 64
    block_ms: int = 500
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    claim_interval_s: float = 1.0
    claim_min_idle_ms: int = 2000
    max_deliveries: int = 3
    keep_alive_s: float | None = None  # None: serve until stopped
    reply_ttl_s: float = 600.0
    # A loop that has not advanced for this many heartbeat TTLs while it holds requests is stuck: it stops
    # heartbeating, so other workers claim its requests (a long prefill stays well under it).
    stall_after_ttls: float = 12.0
    # What the controller reads besides liveness (gpu, backbone, shape, mem_bytes): see lorafn.controller.
    heartbeat_fields: dict[str, Any] = field(default_factory=dict)
    # SLO-aware batching (lorafn.runtime.batching); the default (no device id) asks no GPU slot
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # fields read again at every heartbeat (the worker's memory, which grows with use)
    live_fields: Callable[[], dict[str, Any]] | None = None
    # one INFO line per finished request with where its time went (`request_timing`)
    request_log: bool = True
    # torch.profiler over the first `profile_steps` engine steps, written under `profile_dir` (step_profile)
    profile_steps: int = 0
    profile_dir: str | None = None
    # a control command (park, unpark, stop) is seen within this long: the idle read blocks at most this and
    # reads the control stream in the same round trip; a busy worker reads it between steps this often
    control_poll_ms: int = 100
    # a parked worker that sees its function's requests queued records demand at most this often
    park_demand_guard_ms: int = 2000
    # hold no more requests than the KV cache is expected to serve at once (runtime.read_cap): the rest stay
    # queued in the stream, where the controller sees them and other workers of the function can take them
    kv_read_cap: bool = True
    # the KV tokens a request is expected to hold before any of this worker's requests has finished
    expected_tokens_prior: float = DEFAULT_EXPECTED_TOKENS

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.heartbeat_ttl_s <= self.heartbeat_s:
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        if self.keep_alive_s is not None and self.keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {self.keep_alive_s}")
        if self.control_poll_ms < 1:
            raise ValueError(f"control_poll_ms must be >= 1, got {self.control_poll_ms}")


def default_worker_id() -> str:
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{os.urandom(2).hex()}".replace("_", "-")


@dataclass
class _Running:
    request_id: str
    entry_id: str
    function: str = ""  # whose request stream it came from (a worker with adapter slots serves several)
    completion_tokens: int = 0
    arrival_ms: float = 0.0  # when the gateway enqueued it (the entry id's server time)
    # where the request's time went (`request_timing`): unix ms for what compares with the entry id
    # (Redis's clock), the loop's clock for the durations inside this worker
    read_ms: float = 0.0  # unix ms the worker read it
    read_at: float = 0.0
    first_step_at: float | None = None  # the first engine step that could prefill it began
    first_token_at: float | None = None  # the step that gave its first token ended
    first_sent_ms: float | None = None  # unix ms its first delta went out (the pipeline after that step)
    steps: int = 0  # engine steps until its first token (> 1: chunked, or admission ran decodes only)
    first_of_worker: bool = False  # the first request this worker took (a cold start's request)
    gc_ms_at_read: float = 0.0  # GC_CLOCK when it was read


@dataclass
class _Joined:
    """A function that joined a worker with adapter slots after its first: its keep-alive (None: serve
    until stopped), its TTFT SLO in ms (0: none) and when it last had work (the loop's clock)."""

    keep_alive_s: float | None
    ttft_ms: float
    last_busy: float


class GcClock:
    """Milliseconds this process spent in the garbage collector (every generation; a `gc.callbacks`
    entry): a request's line says how much of its time went there (a full collection stops every thread
    for as long as it walks the heap, see standby.settle_heap)."""

    def __init__(self) -> None:
        self.total_ms = 0.0
        self._started = 0.0

    def __call__(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total_ms += (time.perf_counter() - self._started) * 1000

    def install(self) -> GcClock:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self


GC_CLOCK = GcClock()


def request_timing(run: _Running, done_ms: float) -> dict[str, float]:
    """Where one finished request spent its time, in ms: `queued` (enqueued -> read by the worker),
    `held` (read -> the first engine step that could prefill it: fill or expire, GPU admission),
    `prefill` (that step's start -> its first token), `first_token` (enqueued -> its first delta sent),
    `total` (enqueued -> done). Pure; a stage the request never reached is left out."""
    out = {"queued": max(0.0, run.read_ms - run.arrival_ms)}
    if run.first_step_at is not None:
        out["held"] = max(0.0, (run.first_step_at - run.read_at) * 1000)
        if run.first_token_at is not None:
            out["prefill"] = max(0.0, (run.first_token_at - run.first_step_at) * 1000)
    if run.first_sent_ms is not None:
        out["first_token"] = max(0.0, run.first_sent_ms - run.arrival_ms)
    out["total"] = max(0.0, done_ms - run.arrival_ms)
    return out


class Worker:
    """The serving loop of one worker. `run()` returns the process exit code."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        engine: ServingEngine,
        config: ServingConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.keys, self.engine, self.config, self.clock = store, keys, engine, config, clock
        self.function = config.function
        self.worker_id = config.worker_id
        self.running: dict[str, _Running] = {}
        self._events: list[tuple[str, ReplyEvent]] = []
        self._acks: list[tuple[str, str]] = []  # (function, entry id)
        self._counters: dict[str, dict[str, int]] = {}  # function -> stats counter -> increment
        self._draining = False
        self._control_cursor: str | None = None  # read from where the stream ends at start (run)
        # busy, the control stream rides on the read after a step once this (clock) has passed
        self._next_control = 0.0
        self._started = time.time()
        self._last_busy = clock()
        self._progress_at = clock()  # the loop's last iteration: the heartbeat thread reads it
        # the loop's first read went out / its first request got its first token out (the first heartbeat
        # waits for one of them, see _heartbeats)
        self._reading = threading.Event()
        self._answered = threading.Event()
        # registered under the function already (a bound standby: its bind or claim heartbeat did it)
        self.registered = False
        self._with_next: list[Op[Any]] = []  # writes that ride on the loop's next round trip (send_with_next)
        self._record: Any = None  # the function's registration, when the caller has it (run reads it else)
        self._prepared = False  # consumer group and batching loaded ahead (`prepare`)
        self.defer_first_claim_s = 0.0  # the first sweep for dead workers' requests waits this long
        self.served = 0
        self._taken = 0  # requests admitted (the first one is the cold start's)
        self._first_out: list[_Running] = []  # first deltas queued in `_events`, not yet sent
        self._done_out: list[tuple[_Running, str, int, int]] = []  # finished, logged once sent
        if config.request_log:
            GC_CLOCK.install()
        self.profiler = StepProfiler(config.profile_steps, config.profile_dir, self.worker_id)
        self.batching = Batching(store, keys, self.worker_id, self.function, config.batching, clock=clock)
        # work for idle time, one piece per call, False once none is left (an engine started with
        # `lazy_graphs` captures its remaining decode graphs so); None: nothing to do
        self._idle_work: Callable[[], bool] | None = getattr(engine, "capture_pending_graph", None)
        # parked (a `park` command): the engine holds no KV cache; no requests are read (docs/runtime.md)
        self.parked = False
        # a park command's `keep_alive_s` (the controller's PolicyConfig.parked_keep_alive_s; inf: never):
        # replaces `keep_alive_s` while parked; None: the function's (docs/runtime.md#parking)
        self._parked_keep_alive_s: float | None = None
        self._kv_grant: int | None = None  # a `kv_budget` command's bytes (None: the start's budget)
        self._kv_start_bytes = 0  # the KV cache's bytes before the first grant (what a park returns to)
        self._expected_tokens = ExpectedTokens(config.expected_tokens_prior)  # runtime.read_cap
        # Adapter slots (docs/runtime.md#adapter-slots): the functions this worker serves -> their slot. The
        # first (`function`, bound at start) stays until the process exits; others join with a `bind`
        # command and leave when idle past their keep-alive (their slot emptied).
        self.slots: dict[str, int] = {self.function: 0}
        self.num_slots = int(getattr(engine, "num_adapter_slots", 1) or 1)
        self._joined: dict[str, _Joined] = {}

    # -- public ---------------------------------------------------------------------------------
    @property
    def functions(self) -> list[str]:
        """The functions this worker serves, the first one first."""
        return list(self.slots)

    def drain(self, *_: Any) -> None:
        """Stop reading new requests; finish the running ones, then `run` returns 0 (SIGTERM handler)."""
        if not self._draining:
            log.info("worker %s draining (%d running)", self.worker_id, len(self.running))
        self._draining = True

    def send_with_next(self, op: Op[Any], record: Any = None) -> None:
        """Send `op` with the loop's next round trip (its first read, when called before `run`) instead of
        a round trip of its own; `record`: the function's registration, so `run` need not read it. A bound
        standby posts its `bound` event so: the first read of its cold start goes out milliseconds sooner."""
        self._with_next.append(op)
        if record is not None:
            self._record = record

    def prepare(self, record: Any) -> None:
        """What `run` does first, done ahead (a standby that will take its pre-loaded function's first
        request: these round trips are then not inside the cold start): the consumer group, and the SLO and
        latency profile from `record`, the function's registration."""
        self._ensure_group()
        self._record = record
        self._load_batching()
        self._prepared = True

    def continue_control_after(self, entry_id: str) -> None:
        """Read control commands after `entry_id` (a bound standby: after its `bind`)."""
        self._control_cursor = entry_id

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.drain)
        signal.signal(signal.SIGINT, self.drain)

    def run(self) -> int:
        cfg = self.config
        if self._control_cursor is None:
            self._control_cursor = self.store.run(workers.last_control_id(self.keys, self.worker_id))
        if not self._prepared:
            self._ensure_group()
            self._load_batching()
        # the first heartbeat comes from the thread at once, not from here: on a GPU it reads the driver's
        # process list (NVML, milliseconds) and a bound standby, already registered under the function
        # while binding, would make its first request wait for it
        beating = threading.Event()
        beater = threading.Thread(target=self._heartbeats, args=(beating,), name="heartbeat", daemon=True)
        beater.start()
        now = self.clock()
        next_claim = now + self.defer_first_claim_s
        self._last_busy = now
        outage_since: float | None = None
        try:
            while True:
                try:
                    now = self._progress_at = self.clock()
                    if outage_since is not None:
                        self._recover_after_outage()
                        log.warning(
                            "worker %s: Redis is back after %.1f s", self.worker_id, now - outage_since
                        )
                        outage_since = None
                    if self._joined:
                        self._leave_idle()
                    if now >= next_claim and not self._draining and not self.parked:
                        self._claim_dead()
                        next_claim = now + cfg.claim_interval_s
                    if self.running:
                        hold_ms = 0.0 if self._draining else self.batching.hold_left_ms(len(self.running))
                        if hold_ms > 0:  # fill or expire: wait for companions of the first prefill
                            self._read(block_ms=max(1, int(hold_ms)))
                            continue
                        self._step()
                        self._last_busy = self.clock()
                        continue
                    if self._draining:
                        self._flush()
                        return 0
                    if self.parked:  # no requests read: the queue is watched, demand recorded, control read
                        self._parked_wait()
                        keep = self._keep_alive_s()
                        if keep is not None and self.clock() - self._last_busy >= keep:
                            log.info("worker %s: parked and idle for %.0f s, exiting", self.worker_id, keep)
                            self._flush()
                            return 0
                        continue
                    # idle work (decode graphs a fresh worker left for later) goes one piece at a time
                    # between reads that barely wait: a request arriving meanwhile waits for one piece
                    idle_work = self._idle_work is not None and not self._draining
                    got = self._read(block_ms=1 if idle_work else min(cfg.block_ms, cfg.control_poll_ms))
                    if got or self.running:
                        self._last_busy = self.clock()
                    elif self.parked:  # parked by a command of that read
                        pass
                    elif idle_work:
                        if self._idle_work is not None and not self._idle_work():
                            self._idle_work = None
                    elif cfg.keep_alive_s is not None and self.clock() - self._last_busy >= cfg.keep_alive_s:
                        log.info("worker %s: idle for %.0f s, exiting", self.worker_id, cfg.keep_alive_s)
                        self._flush()
                        return 0
                except UNAVAILABLE_ERRORS as e:
                    if outage_since is None:
                        outage_since = self.clock()
                        log.warning(
                            "worker %s: Redis unreachable (%s); aborting %d running requests",
                            self.worker_id,
                            e,
                            len(self.running),
                        )
                        for rid in list(self.running):
                            self.engine.abort(rid)
                        self.running.clear()
                        self._events.clear()
                        self._acks.clear()
                        self._first_out.clear()
                        self._done_out.clear()
                    if self._draining:
                        return 0
                    time.sleep(min(2.0, 0.1 + (self.clock() - outage_since) / 4))
                except redis.ResponseError as e:
                    if "NOGROUP" not in str(e):
                        raise
                    log.warning("worker %s: request stream or group vanished; recreating", self.worker_id)
                    self._ensure_group()
        finally:
            beating.set()
            beater.join(timeout=cfg.heartbeat_s + 5)
            with contextlib.suppress(UNAVAILABLE_ERRORS, redis.ResponseError):
                self.store.run(
                    combine(
                        workers.deregister(self.keys, self.worker_id, self.function),
                        *(workers.leave(self.keys, self.worker_id, f) for f in self.functions[1:]),
                    )
                )
                if not self.running:  # a clean exit holds nothing: leave the consumer groups too
                    for function in self.functions:
                        self._forget_dead_consumers(function, only=self.worker_id)

    # -- the loop's parts -----------------------------------------------------------------------
    def _ensure_group(self, only: str | None = None) -> None:
        """The consumer group of each function's request stream (or of `only`)."""
        for function in [only] if only else self.functions:
            try:
                self.store.run(streams.create_group(self.keys, function))
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def _load_batching(self) -> None:
        """The SLO and the stored latency profile (one round trip at start)."""
        from lorafn.store.registry import get_function

        try:
            record = self._record or self.store.run(get_function(self.keys, self.function))
            self.batching.load(record)
        except ValueError as e:  # a registration that does not validate: serve without SLO batching
            log.warning("worker %s: no SLO-aware batching (%s)", self.worker_id, e)

    def _heartbeats(self, stop: threading.Event) -> None:
        """Heartbeat thread, on its own connection: liveness must not depend on how long one engine step
        takes (a long prefill would otherwise let another worker claim requests that are still running)."""
        # The first beat's connection set-up and fields (NVML) take the GIL, and the loop, back from a round
        # trip, waits for the GIL up to the interpreter's switch interval (5 ms): on the H100 a bound
        # standby's first read came ~4 ms after its loop started while the first beat ran. A bound standby
        # (registered under the function since its bind or claim) so beats once its first request has its
        # first token out; a fresh worker once its first read went out (it is not registered yet: until
        # it beats, the gateway counts every request as a cold start). Either at most FIRST_BEAT_WAIT_S.
        store = Store(self.store.url)
        (self._answered if self.registered else self._reading).wait(FIRST_BEAT_WAIT_S)
        stall_s = self.config.stall_after_ttls * self.config.heartbeat_ttl_s
        withheld = False
        try:
            first = True
            while first or not stop.wait(self.config.heartbeat_s):
                first = False
                stuck = bool(self.running) and self.clock() - self._progress_at > stall_s
                if stuck and not withheld:
                    log.error(
                        "worker %s: no progress for %.0f s; heartbeat withheld", self.worker_id, stall_s
                    )
                withheld = stuck
                if stuck:  # a hung step: look dead, so the requests it holds are claimed elsewhere
                    continue
                with contextlib.suppress(UNAVAILABLE_ERRORS):  # the loop notices an outage on its own
                    self._heartbeat(store)
        finally:
            store.close()

    def _heartbeat(self, store: Store) -> None:
        fields = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "state": "draining" if self._draining else "serving",
            "running": len(self.running),
            "served": self.served,
            "started": int(self._started),
            "idle_s": round(0.0 if self.running else max(0.0, self.clock() - self._last_busy), 1),
            "progress_s": round(max(0.0, self.clock() - self._progress_at), 1),  # since the loop advanced
            **self.config.heartbeat_fields,
            **(self.config.live_fields() if self.config.live_fields else {}),
            **self._park_fields(),
            **self._caps(),
            # a heartbeat updates fields and never removes one: kv_grant is always written
            "kv_grant": int(self._kv_grant is not None),
            **({"kv_budget_bytes": self._kv_grant} if self._kv_grant is not None else {}),
        }
        if self.num_slots > 1:  # what the controller joins functions by (docs/runtime.md#adapter-slots)
            fields["slots"], fields["free_slots"] = self.num_slots, self.num_slots - len(self.slots)
        ttl_ms = int(self.config.heartbeat_ttl_s * 1000)
        also = self.functions[1:]
        store.run(workers.heartbeat(self.keys, self.worker_id, self.function, ttl_ms, fields, also=also))

    def _handle_control(self, commands: list[tuple[str, dict[str, str]]]) -> None:
        """Commands sent to this worker (`stop`, `drain`, `park`, `unpark`, `kv_budget`), read by `_read`
        or, parked, `_parked_wait`."""
        for entry_id, body in commands:
            self._control_cursor = entry_id
            if body.get("cmd") in ("stop", "drain"):
                self.drain()
            elif body.get("cmd") == "park":
                self._park(body.get("keep_alive_s"))
            elif body.get("cmd") == "unpark":
                self._unpark()
            elif body.get("cmd") == "kv_budget":
                self._resize_kv(body.get("bytes"))
            elif body.get("cmd") == "bind" and body.get("function") in self.slots:
                # the controller's bind for the request this worker (a pre-loaded standby) took itself
                log.debug("worker %s: already serving %s", self.worker_id, body.get("function"))
            elif body.get("cmd") == "bind" and body.get("function"):
                self._join(body["function"])
            else:
                log.warning("worker %s: ignoring control command %r", self.worker_id, body)

    # -- parking (docs/runtime.md#parking) ----------------------------------------------------------
    def _park_fields(self) -> dict[str, int]:
        """Heartbeat fields of an engine that can park: parked 1|0, and park_release_bytes (what parking
        frees now; parked: what unparking takes back). The engine's kv_bytes (0 parked) come with
        `live_fields`."""
        release = getattr(self.engine, "park_release_bytes", None)
        if not callable(release):
            return {}
        return {"parked": int(self.parked), "park_release_bytes": int(release())}

    def _post(self, kind: str, function: str | None = None, **fields: Any) -> None:
        gpu = self.config.heartbeat_fields.get("gpu") or self.config.batching.gpu
        self.store.run(
            control.post_event(
                self.keys, kind, worker=self.worker_id, function=function or self.function, gpu=gpu, **fields
            )
        )

    # -- adapter slots: functions joining and leaving (docs/runtime.md#adapter-slots) -------------------
    def _join(self, function: str) -> None:
        """A `bind` command for another function: serve it from a free adapter slot, beside the functions
        this worker serves (its adapter loaded while their requests run on), and answer `bound` (path
        "join") or `bind_failed` (reason) on the lifecycle stream."""
        from lorafn.api import LoRAFunctionSpec

        t0 = time.perf_counter()
        try:
            record, slot = self._join_check(function)
            parsed = LoRAFunctionSpec.model_validate(record.spec or {})
            how = self.engine.load_adapter(slot, record.adapter_dir)  # type: ignore[attr-defined]
            self._ensure_group(function)
        except (ValueError, redis.ResponseError) as e:
            log.warning(
                "worker %s: cannot serve %s beside %s: %s", self.worker_id, function, self.functions, e
            )
            self._post(control.BIND_FAILED, function=function, reason=f"join refused: {e}")
            return
        self.slots[function] = slot
        self._joined[function] = _Joined(
            float(parsed.scaling.keep_alive_seconds), float(parsed.slo.ttft_ms), self.clock()
        )
        self._heartbeat(self.store)  # registered under it now: the gateway sends its requests here
        ms = (time.perf_counter() - t0) * 1000
        self._post(control.BOUND, function=function, ms=round(ms, 1), path=control.PATH_JOIN)
        log.info(
            "worker %s joined %s into adapter slot %d of %d in %.1f ms (%s); serving %s",
            self.worker_id, function, slot, self.num_slots, ms, how, ", ".join(self.functions),
        )  # fmt: skip

    def _join_check(self, function: str) -> tuple[Any, int]:
        """`function`'s registration and the free slot it takes; ValueError naming why it cannot join."""
        from lorafn.api import FunctionRef
        from lorafn.store.registry import get_function

        if self.num_slots < 2:
            raise ValueError("this worker has no adapter slots (one adapter per process)")
        if self._draining or self.parked:
            raise ValueError("the worker is draining" if self._draining else "the worker is parked")
        ref, first = FunctionRef.parse(function), FunctionRef.parse(self.function)
        if ref.namespace != first.namespace:
            # one process is one fault domain: only one namespace's (one tenant's) functions share it
            raise ValueError(f"namespace {ref.namespace!r}: this worker serves namespace {first.namespace!r}")
        free = sorted(set(range(self.num_slots)) - set(self.slots.values()))
        if not free:
            raise ValueError(f"all {self.num_slots} adapter slots are taken")
        record = self.store.run(get_function(self.keys, function))
        if record is None:
            raise ValueError("not registered")
        backbone = self.config.heartbeat_fields.get("backbone") or self.config.batching.backbone
        theirs = str((record.spec or {}).get("backbone") or "")
        if backbone and theirs != backbone:
            raise ValueError(f"backbone {theirs!r}: this worker holds {backbone!r}")
        if not record.adapter_dir:
            raise ValueError("no adapter directory")
        return record, free[0]

    def _leave_idle(self) -> None:
        """Joined functions idle past their keep-alive leave: their slot is emptied and the worker is no
        longer registered under them (their next request is a cold start elsewhere). The first function
        stays until the process exits (its keep-alive ends the worker)."""
        now = self.clock()
        busy = {run.function for run in self.running.values()}
        for function, joined in list(self._joined.items()):
            if function in busy:
                joined.last_busy = now
                continue
            if joined.keep_alive_s is None or now - joined.last_busy < joined.keep_alive_s:
                continue
            try:
                self.engine.load_adapter(self.slots[function], None)  # type: ignore[attr-defined]
            except ValueError as e:  # a request of it still in the engine
                log.debug("worker %s: %s stays: %s", self.worker_id, function, e)
                continue
            del self.slots[function], self._joined[function]
            self.store.run(workers.leave(self.keys, self.worker_id, function))
            self._forget_dead_consumers(function, only=self.worker_id)
            log.info(
                "worker %s: %s idle for %.0f s, left its adapter slot; serving %s",
                self.worker_id, function, joined.keep_alive_s, ", ".join(self.functions),
            )  # fmt: skip

    def _keep_alive_s(self) -> float | None:
        """The keep-alive that applies now: parked, the park command's `keep_alive_s` when it named one
        (inf: never), else the function's `ServingConfig.keep_alive_s` (None: serve until stopped)."""
        if self.parked and self._parked_keep_alive_s is not None:
            return self._parked_keep_alive_s
        return self.config.keep_alive_s

    def _parse_keep_alive(self, value: str | None) -> float | None:
        """A park command's `keep_alive_s`: seconds >= 0 or "inf" (never); absent: None (the function's). A
        bad value is logged and ignored (None): a parked worker then keeps its function's keep-alive."""
        if value is None:
            return None
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = math.nan
        if not seconds >= 0:  # NaN too
            log.warning(
                "worker %s: park command with a bad keep_alive_s %r (seconds >= 0 or inf); keeping the "
                "function's keep-alive (%s s)", self.worker_id, value, self.config.keep_alive_s,
            )  # fmt: skip
            return None
        return seconds

    def _park(self, keep_alive_s: str | None = None) -> None:
        """A `park` command: release the engine's KV cache and decode graphs when idle, and answer `parked`
        (released_bytes) or `park_refused` (reason) on the lifecycle stream. A parked worker answers
        `parked` again (the first park's bytes). The command's `keep_alive_s` (seconds or "inf"; the
        controller's parked keep-alive) replaces the function's keep-alive while parked (a park of a parked
        worker updates it; `unpark` restores the function's)."""
        park = getattr(self.engine, "park", None)
        reason = ""
        if not callable(park):
            reason = "the engine cannot park"
        elif self._draining:
            reason = "draining"
        elif not self.parked and (self.running or self.engine.has_unfinished()):
            reason = f"busy: {len(self.running)} running"
        released, t0 = 0, time.perf_counter()
        if not reason and self._kv_grant is not None and not self.parked:
            # a KV grant (a batch's or a burst's) ends with a park: unparked, the worker takes back its
            # start's cache
            try:
                self.engine.resize_kv(self._kv_start_bytes)
                self._kv_grant = None
            except ParkRefused as e:
                reason = str(e)
        if not reason:
            try:
                released = int(park())  # type: ignore[misc]
            except ParkRefused as e:
                reason = str(e)
        if reason:
            log.info("worker %s: park refused (%s)", self.worker_id, reason)
            self._post(control.PARK_REFUSED, reason=reason)
            return
        ms = (time.perf_counter() - t0) * 1000
        self._parked_keep_alive_s = self._parse_keep_alive(keep_alive_s)
        if not self.parked:
            self.parked = True
            self._count("parks")
            log.info(
                "worker %s parked: released %d bytes (%.1f MiB) in %.0f ms; keep-alive %s s",
                self.worker_id, released, released / 2**20, ms, self._keep_alive_s(),
            )  # fmt: skip
        self._post(control.PARKED, released_bytes=released)

    def _unpark(self) -> None:
        """An `unpark` command: the engine takes its KV cache back (decode graphs captured lazily, in idle
        time as after a lazy start) and the worker reads requests again; answers `unparked` (kv_bytes). An
        unpark of an unparked worker answers `unparked` with its current KV bytes. An unpark that fails
        (the device has no room) drains the worker: it exits, and the controller sees it gone."""
        unpark = getattr(self.engine, "unpark", None)
        if not callable(unpark):
            self._post(control.UNPARKED, kv_bytes=0)
            return
        t0 = time.perf_counter()
        try:
            kv_bytes = int(unpark())
        except Exception:
            log.exception("worker %s: unpark failed; exiting", self.worker_id)
            self.drain()
            return
        if self.parked:
            self.parked = False
            self._parked_keep_alive_s = None  # the function's keep-alive again
            self._last_busy = self.clock()  # keep-alive counts from here: the unpark is for a request
            self._idle_work = getattr(self.engine, "capture_pending_graph", None)  # the graphs, lazily
            self._count("unparks")
            log.info(
                "worker %s unparked: KV cache of %d bytes (%.1f MiB) back in %.0f ms",
                self.worker_id, kv_bytes, kv_bytes / 2**20, (time.perf_counter() - t0) * 1000,
            )  # fmt: skip
        self._post(control.UNPARKED, kv_bytes=kv_bytes)

    def _resize_kv(self, value: str | None) -> None:
        """A `kv_budget` command (the controller's grant of more KV for an offline batch, or its return;
        docs/batch.md#kv-from-idle-memory): resize the engine's KV cache to `bytes` between steps, requests
        running on (`Engine.resize_kv`), and answer `kv_resized` (kv_bytes, budget_bytes) or
        `kv_resize_refused` (reason: parked, a block in use above the new size, a bad value). The heartbeat's
        `kv_budget_bytes` names the grant from then on."""
        resize = getattr(self.engine, "resize_kv", None)
        try:
            budget = int(str(value))
        except (TypeError, ValueError):
            budget = -1
        reason = ""
        if budget <= 0:
            reason = f"bytes: {value!r} is not a positive integer"
        elif not callable(resize):
            reason = "the engine cannot resize its KV cache"
        elif self._draining:
            reason = "draining"
        kv_bytes, t0 = 0, time.perf_counter()
        if not reason:
            if self._kv_grant is None:
                self._kv_start_bytes = int(self.engine.runner.memory_parts()[0])
            try:
                kv_bytes = int(resize(budget))  # type: ignore[misc]
            except ParkRefused as e:
                reason = str(e)
            except Exception as e:  # the device had no room: the old cache is kept, the worker serves on
                log.exception("worker %s: KV resize to %d bytes failed", self.worker_id, budget)
                reason = f"failed: {type(e).__name__}: {e}"
        if reason:
            log.info("worker %s: KV resize to %s bytes refused (%s)", self.worker_id, value, reason)
            self._post(control.KV_RESIZE_REFUSED, reason=reason, budget_bytes=max(0, budget))
            return
        # at or below the start's cache: no grant held any more (the heartbeat names the start's budget again)
        self._kv_grant = budget if kv_bytes > self._kv_start_bytes else None
        self._idle_work = getattr(self.engine, "capture_pending_graph", None)  # the graphs, lazily
        self._count("kv_resizes")
        log.info(
            "worker %s: KV cache resized to %d bytes (%.1f MiB; budget %.1f MiB) in %.0f ms, %d running",
            self.worker_id, kv_bytes, kv_bytes / 2**20, budget / 2**20, (time.perf_counter() - t0) * 1000,
            len(self.running),
        )  # fmt: skip
        self._post(control.KV_RESIZED, kv_bytes=kv_bytes, budget_bytes=budget)

    def _parked_wait(self) -> None:
        """One iteration of a parked worker, one round trip: send what is queued, wait up to
        `control_poll_ms` for a control command, then read the function's queue depth (after the wait:
        what arrived during it counts). Requests queued and not yet delivered to any worker (another
        worker of the function may take them, or none is left unparked) -> demand recorded (reason
        "parked", deduplicated over `park_demand_guard_ms`), so that the controller unparks a worker or
        binds another; the request stays in the stream meanwhile."""
        cfg = self.config
        ops = self._pending_ops()
        at = len(ops)
        ops.append(
            workers.read_control(
                self.keys, self.worker_id, self._control_cursor or "0", block_ms=cfg.control_poll_ms
            )
        )
        ops.append(control.queue_depths(self.keys, self.functions))
        results = self.store.run(combine(*ops))
        self._sent()
        commands, depths = results[at], results[at + 1]
        self._handle_control(commands)
        for function, depth in depths.items():
            if not depth.queued or not self.parked:
                continue
            recorded = self.store.run(
                streams.record_demand(self.keys, function, "parked", cfg.park_demand_guard_ms)
            )
            if recorded:
                log.info(
                    "worker %s: parked with %d requests of %s queued; demand recorded",
                    self.worker_id, depth.queued, function,
                )  # fmt: skip

    def _caps(self) -> dict[str, int]:
        """What bounds the requests it holds at once: `slot_cap` (`max_running`, or the TPOT SLO's batch) and,
        with the KV read cap on, `kv_cap` (what its KV cache is expected to serve, `runtime.read_cap`). The
        heartbeat carries both: more KV helps a burst only where `kv_cap` is the smaller
        (`PolicyConfig.burst_kv_bytes`)."""
        caps = {"slot_cap": self.batching.max_running(self.config.max_running)}
        capacity = getattr(self.engine, "kv_capacity_tokens", None)
        if self.config.kv_read_cap and callable(capacity) and not self.parked:
            caps["kv_cap"] = held_cap(int(capacity()), self._expected_tokens.value)
        return caps

    def _free_slots(self) -> int:
        if self._draining or self.parked:
            return 0
        return max(0, min(self._caps().values()) - len(self.running))

    def _pending_ops(self) -> list[Op[Any]]:
        ops: list[Op[Any]] = self.batching.pipeline_ops(busy=bool(self.running))
        if self._events:
            ops.append(
                streams.reply_events(
                    self.keys, self.worker_id, self._events, int(self.config.reply_ttl_s * 1000)
                )
            )
        acks: dict[str, list[str]] = {}
        for function, entry_id in self._acks:
            acks.setdefault(function, []).append(entry_id)
        ops += [streams.ack(self.keys, function, ids) for function, ids in acks.items()]
        ops += [
            store_stats.add_counters(self.keys, function, **counters)
            for function, counters in self._counters.items()
            if counters
        ]
        if self._with_next:
            ops.append(combine(*self._with_next))  # one Op: nothing reads results by position from here
        return ops

    def _sent(self) -> None:
        self._events, self._acks, self._counters, self._with_next = [], [], {}, []
        if self._first_out:
            self._answered.set()
        if self._first_out or self._done_out:
            now_ms = time.time() * 1000
            for run in self._first_out:
                run.first_sent_ms = now_ms
            self._first_out = []
            for run, reason, prompt, completion in self._done_out:
                self._log_request(run, reason, prompt, completion, now_ms)
            self._done_out = []

    def _log_request(self, run: _Running, reason: str, prompt: int, completion: int, done_ms: float) -> None:
        """One line per finished request (key=value: benchmarks parse it; see `request_timing`)."""
        if not self.config.request_log:
            return
        timing = request_timing(run, done_ms)
        timing["gc"] = GC_CLOCK.total_ms - run.gc_ms_at_read  # the collector's share of its life
        log.info(
            "request rid=%s function=%s finish=%s %s steps=%d prompt_tokens=%d completion_tokens=%d "
            "first_of_worker=%d",
            run.request_id, run.function or self.function, reason,
            " ".join(f"{k}_ms={v:.1f}" for k, v in timing.items()),
            run.steps, prompt, completion, int(run.first_of_worker),
        )  # fmt: skip

    def _flush(self) -> None:
        ops = self._pending_ops()
        if ops:
            self.store.run(combine(*ops))
        self._sent()

    def _read(self, block_ms: int | None) -> int:
        """Send queued events and read new entries, in one round trip; returns how many arrived. The control
        stream is read in the same round trip (before the blocking read; see `ServingConfig.control_poll_ms`)
        with no request running, and busy every `control_poll_ms` (a park is answered, refused, within a poll:
        the controller waits for that answer); its commands are handled after the entries are admitted (a
        `park` that comes with a request is refused)."""
        self._reading.set()
        now = self.clock()
        control = not self.running or now >= self._next_control
        if control and self.running:
            self._next_control = now + self.config.control_poll_ms / 1000
        free = self._free_slots()
        ops = self._pending_ops()
        at = len(ops)
        check = list(self.running)  # their cancel flags, read in the same round trip
        if check:
            ops.append(cancel.cancelled(self.keys, check))
        if control:
            ops.append(workers.read_control(self.keys, self.worker_id, self._control_cursor or "0"))
        several = bool(free) and len(self.slots) > 1
        if several:
            # XREADGROUP's COUNT is per stream: a share each, so at most len(slots) - 1 over `free` (the
            # engine queues them)
            share = -(-free // len(self.slots))
            ops.append(streams.read_requests_of(self.keys, self.functions, self.worker_id, share, block_ms))
        elif free:
            ops.append(streams.read_requests(self.keys, self.function, self.worker_id, free, block_ms))
        if not ops:
            return 0
        results = self.store.run(combine(*ops))
        self._sent()
        if check:
            self._abort_cancelled(results[at])
            at += 1
        commands = results[at] if control else []
        entries: list[tuple[str, str, dict[str, str]]] = []
        if several:
            entries = results[-1]
        elif free:
            entries = [(self.function, entry_id, fields) for entry_id, fields in results[-1]]
        idle_before = not self.running
        for function, entry_id, fields in entries:
            self._admit(entry_id, fields, restart=False, function=function)
            if function in self._joined:
                self._joined[function].last_busy = self.clock()
        self.batching.arrived(
            [entry_ms(e) for _, e, _ in entries], idle_before and bool(self.running), self.config.max_running
        )
        if entries:  # `accepted` at once, not after the next engine step (the gateway's accept deadline)
            self._flush()
        if commands:
            self._handle_control(commands)
        return len(entries)

    def _step(self) -> None:
        allow_prefill = True
        if self.batching.gated(self.engine):
            waiting = {rid: r.arrival_ms for rid, r in self.running.items() if not r.completion_tokens}
            allow_prefill = self.batching.allow_prefill(self.engine, waiting, self.running)
            if not allow_prefill and len(waiting) == len(self.running):  # nothing to decode: wait
                self.batching.wait_for_slot()
                self._read(block_ms=None)
                return
        # decode gating: wait (bounded) while another worker's urgent prefill runs (no-op unless seen)
        self.batching.pause_decodes(lambda: sum(1 for r in self.running.values() if r.completion_tokens))
        started = time.perf_counter()
        step_at = self.clock()
        for run in self.running.values():
            if run.first_token_at is None:
                run.steps += 1
                if run.first_step_at is None and allow_prefill:
                    run.first_step_at = step_at
        try:
            with self.profiler.step():
                cap = self.batching.prefill_cap if allow_prefill else None  # the granted share's tokens
                if not allow_prefill:
                    deltas = self.engine.step(allow_prefill=False)
                elif cap is not None:
                    deltas = self.engine.step(max_prefill_tokens=cap)
                else:
                    deltas = self.engine.step()
            # nothing ran (its decodes were recomputes, preempted): wait too. With overlapped steps a step
            # that ran returns the previous one's deltas, maybe none: `last_step` says whether one ran
            ran = any(getattr(self.engine, "last_step", (0, 0)))
            if not allow_prefill and not deltas and not ran:
                time.sleep(self.batching.config.poll_ms / 1000)
        except Exception:
            log.exception(
                "worker %s: engine step failed; ending %d requests", self.worker_id, len(self.running)
            )
            for run in self.running.values():
                self._end(
                    run,
                    Error(
                        code="engine_error",
                        message="the worker's engine failed while generating this request",
                    ),
                )
            self.running.clear()
            self._flush()
            raise
        step = getattr(self.engine, "last_step", None)
        pending = getattr(self.engine, "num_pending_prefills", 0)
        # with overlapped steps the call's time is the wait for the step read back, not the one queued
        timed = getattr(self.engine, "last_read_step", "step")
        elapsed_ms = (time.perf_counter() - started) * 1000
        self.batching.after_step(step, elapsed_ms, self.running, pending, timed=timed)
        step_end = self.clock()
        for delta in deltas:
            run = self.running.get(delta.request_id)
            if run is None:
                continue
            num_tokens = len(delta.token_ids)
            if num_tokens and run.first_token_at is None:
                run.first_token_at = step_end
                self._first_out.append(run)
            if delta.text or num_tokens:
                run.completion_tokens += num_tokens
                self._events.append((run.request_id, Delta(text=delta.text, tokens=num_tokens)))
            if delta.finished:
                completion = delta.completion_tokens
                self._end(
                    run,
                    Done(
                        finish_reason=delta.finish_reason or "stop",
                        prompt_tokens=delta.prompt_tokens,
                        completion_tokens=completion,
                    ),
                )
                self._count("prompt_tokens", delta.prompt_tokens, run.function)
                self._count("completion_tokens", completion, run.function)
                self._done_out.append((run, delta.finish_reason or "stop", delta.prompt_tokens, completion))
                self._expected_tokens.add(delta.prompt_tokens, completion)
                del self.running[run.request_id]
                self.served += 1
        self._read(block_ms=None)

    def _abort_cancelled(self, request_ids: set[str]) -> None:
        """Abort requests whose clients went away; their `done` events and acks go with the next pipeline."""
        for rid in request_ids:
            run = self.running.pop(rid, None)
            if run is None:  # finished in the same step
                continue
            try:
                self.engine.abort(rid)
            except Exception:  # the request is dropped either way
                log.exception("worker %s: engine abort of %s failed", self.worker_id, rid)
            self._end(
                run,
                Done(finish_reason=cancel.ABORT, prompt_tokens=0, completion_tokens=run.completion_tokens),
            )
            self._count("cancelled", 1, run.function)
            if run.completion_tokens:
                self._count("completion_tokens", run.completion_tokens, run.function)
            log.info(
                "worker %s: %s cancelled by its client after %d tokens",
                self.worker_id,
                rid,
                run.completion_tokens,
            )

    def _count(self, name: str, n: int = 1, function: str | None = None) -> None:
        """Add `n` to a stats counter of `function` (None: the first function's; the worker's own events),
        sent with the next round trip."""
        counters = self._counters.setdefault(function or self.function, {})
        counters[name] = counters.get(name, 0) + n

    def _end(self, run: _Running, event: Done | Error) -> None:
        self._events.append((run.request_id, event))
        self._acks.append((run.function or self.function, run.entry_id))
        if isinstance(event, Error):
            self._count("errors", 1, run.function)

    def _admit(self, entry_id: str, fields: dict[str, str], restart: bool, function: str = "") -> None:
        """Hand one stream entry of `function` (default: the first) to the engine, or end it with an error
        event."""
        function = function or self.function
        rid = fields.get("rid")
        if not rid:  # deleted while pending (the gateway gave up on it): nothing to answer
            self._acks.append((function, entry_id))
            return
        if rid in self.running:
            return
        run = _Running(
            rid, entry_id, function, arrival_ms=entry_ms(entry_id), read_ms=time.time() * 1000,
            read_at=self.clock(), gc_ms_at_read=GC_CLOCK.total_ms,
        )  # fmt: skip
        try:
            deadline = int(fields.get("deadline") or 0)
        except ValueError:
            self._end(
                run, Error(code="invalid_request", message=f"deadline: {fields['deadline']!r} is no integer")
            )
            return
        if deadline and time.time() * 1000 > deadline:
            self._end(
                run,
                Error(code="expired", message="the request waited past its deadline before a worker took it"),
            )
            return
        try:  # a malformed or unknown body (ProtocolError) or sampling values the engine refuses
            body = RequestBody.decode(fields.get("body"))
            params = SamplingParams(**body.params.model_dump())
        except ValueError as e:
            self._end(run, Error(code="invalid_request", message=str(e)))
            return
        if restart:
            self._events.append((rid, Restart(worker=self.worker_id, reason="previous worker died")))
        self._events.append((rid, Accepted(worker=self.worker_id)))
        prompt = body.prompt_token_ids or body.prompt or ""
        try:
            if self.num_slots > 1:  # each function's requests run on its own adapter slot
                self.engine.add_request(prompt, params, request_id=rid, adapter_slot=self.slots[function])  # type: ignore[call-arg]
            else:
                self.engine.add_request(prompt, params, request_id=rid)
        except ValueError as e:
            self._end(run, Error(code="invalid_request", message=str(e)))
            return
        joined = self._joined.get(function)
        ttft_ms = joined.ttft_ms if joined is not None else self.batching.config.ttft_ms
        set_deadline = getattr(self.engine, "set_deadline", None)
        if ttft_ms and callable(set_deadline) and not params.priority:  # batch requests have no TTFT SLO
            set_deadline(rid, (run.arrival_ms + ttft_ms) / 1000)  # the enqueue clock (unix) + the SLO
        run.first_of_worker = self._taken == 0
        self._taken += 1
        self.running[rid] = run

    def _claim_dead(self) -> None:
        """Take over entries held by workers without a live heartbeat; restart them from scratch."""
        for function in self.functions:
            self._claim_dead_of(function)

    def _claim_dead_of(self, function: str) -> None:
        cfg = self.config
        ttl_ms = int(cfg.heartbeat_ttl_s * 1000)
        now_ms, stale = self.store.run(
            combine(workers.server_time_ms(), streams.pending(self.keys, function, cfg.claim_min_idle_ms))
        )
        if not stale:
            return
        live = set(self.store.run(workers.live_workers(self.keys, function, ttl_ms, now_ms)))
        live.add(self.worker_id)
        dead = [p for p in stale if p.consumer not in live]
        if not dead:
            return
        room = max(1, self._free_slots())
        take = dead[:room]
        claimed = self.store.run(
            streams.claim(
                self.keys, function, self.worker_id, cfg.claim_min_idle_ms, [p.entry_id for p in take]
            )
        )
        deliveries = {p.entry_id: p.deliveries for p in take}
        for entry_id, fields in claimed:
            log.warning("worker %s: claimed %s from a dead worker", self.worker_id, entry_id)
            if deliveries.get(entry_id, 0) >= cfg.max_deliveries and fields.get("rid"):
                self._end(
                    _Running(fields["rid"], entry_id, function),
                    Error(
                        code="worker_failures",
                        message=f"workers died {deliveries[entry_id]} times while serving this request",
                    ),
                )
                continue
            self._admit(entry_id, fields, restart=True, function=function)
        self._flush()
        self._forget_dead_consumers(function, live)

    def _forget_dead_consumers(
        self, function: str, live: set[str] | None = None, only: str | None = None
    ) -> None:
        """Remove consumers of dead workers (not in `live`; or just `only`, this worker on exit) from
        `function`'s group that hold nothing any more — deleting one that still held entries would lose
        them — so the group does not grow with every worker that ever ran. Dead workers receive nothing new,
        so no entry can slip in."""
        for name, num_pending, _idle in self.store.run(streams.consumers(self.keys, function)):
            if num_pending == 0 and (name == only if only else name not in (live or set())):
                self.store.run(streams.delete_consumer(self.keys, function, name))

    def _recover_after_outage(self) -> None:
        """After Redis came back: what this worker still held was aborted; tell and ack (see module doc)."""
        self._ensure_group()
        for function in self.functions:
            held = self.store.run(
                streams.read_requests(self.keys, function, self.worker_id, 1000, None, True)
            )
            for entry_id, fields in held:
                rid = fields.get("rid")
                if rid and rid not in self.running:
                    self._end(
                        _Running(rid, entry_id, function),
                        Error(
                            code="data_plane_interrupted",
                            message="Redis was unreachable while this request ran; it was aborted",
                        ),
                    )
                elif not rid:
                    self._acks.append((function, entry_id))
        self._flush()


# -- `lorafn worker serve` ----------------------------------------------------------------------
app = typer.Typer(help="Run a worker: the serving loop of one function.", no_args_is_help=True)


class WorkerSettings(SharedSettings):
    """A worker's configuration (env prefix `LORAFN_`, e.g. `LORAFN_FUNCTION`); Redis URL, key prefix and
    heartbeat TTL come from `SharedSettings`, so they match the gateway's and the operator's."""

    function: str = Field(default="", description="namespace/name of the function to serve")
    worker_id: str | None = None
    model: str | None = Field(default=None, description="backbone model dir (default: the registration's)")
    adapter: str | None = Field(default=None, description="adapter dir (default: the registration's)")
    device: str = "cpu"
    dtype: str = "auto"
    max_running: int = Field(default=64, ge=1)
    keep_alive_seconds: float | None = Field(
        default=None, ge=0, description="exit after this long idle (default: spec.scaling.keepAliveSeconds)"
    )
    heartbeat_s: float = Field(default=1.0, gt=0)
    claim_min_idle_ms: int = Field(default=2000, ge=0)
    stall_after_ttls: float = Field(
        default=12.0, gt=1, description="stuck after this many TTLs without progress"
    )
    engine_factory: str | None = Field(
        default=None,
        description="module:callable(settings, record) -> ServingEngine, instead of lorafn.runtime.Engine "
        "(tests and the gateway benchmark use it for their fake engines)",
    )
    backbone_socket: str | None = Field(
        default=None,
        description="Unix socket of the backbone server: map its weights read-only instead of loading them",
    )
    standby: bool = Field(default=False, description="start tenant-neutral and wait for bind(function)")
    backbone: str | None = Field(default=None, description="the backbone a standby worker serves")
    gpu: str = Field(default="", description="the controller's id of this worker's device (e.g. local/0)")
    shape: str | None = Field(
        default=None,
        description="adapter shape a standby prepares LoRA buffers and graphs for (q_proj:16,...)",
    )
    adapter_slots: int = Field(
        default=1,
        ge=1,
        le=64,
        description="adapters one engine serves in one batch (docs/runtime.md#adapter-slots): the worker "
        "takes further functions of its namespace and backbone into free slots when the controller binds "
        "them to it; 1: one function per process",
    )
    kv_budget_mib: int | None = Field(
        default=None,
        ge=1,
        description="KV-cache budget granted by the controller (never the GPU's free memory)",
    )
    host_kv_mib: int = Field(
        default=2048,
        ge=0,
        description="host memory for the swapped-out KV of preempted requests (docs/batch.md; 0: recompute)",
    )
    lazy_graphs: bool = Field(
        default=True,
        description="a fresh (non-standby) worker serves before capturing its decode CUDA graphs: each is "
        "captured when a decode step first needs it, the rest while idle (its first token waits for none; "
        "~1.2-1.6 s of a 7B's start on an H100)",
    )
    prefill_graph_tokens: TokenBuckets = Field(
        default="",
        description="CUDA: token buckets of prefill CUDA graphs, comma-separated (e.g. 128,512): a prompt's "
        "first chunk alone replays the graph of the smallest bucket that holds it instead of launching each "
        "kernel from Python (EngineConfig.prefill_graph_tokens); empty: none",
    )

    graph_archives: bool = Field(
        default=False,
        description="CUDA: build the decode state in a fixed-address arena and restore decode graphs from "
        "the archive the first worker of the same key wrote, instead of capturing them (graph_cache.py)",
    )
    graph_archive_dir: str | None = Field(
        default=None,
        description="where graph archives live (default: the cache directory); on Kubernetes a volume "
        "shared by the node's workers",
    )
    cuda_stack_bytes: int | None = Field(
        default=256,
        ge=16,
        description="CUDA per-thread stack limit in bytes (~200 MiB less per H100 context than the "
        "driver's 1024; a kernel that needs more grows it)",
    )
    cublas_workspace_kib: int | None = Field(
        # None by default: the one H100 run with 1024 (commit 5918dfd, bench/coldstart.py) had a warm
        # worker's 786-token prefill at 50-63 ms, against a warm TTFT of 31.6 ms the session before with
        # torch's workspace (docs/benchmarks.md); until a side-by-side engine run clears it, memory is
        # not bought with prefill time
        default=None,
        ge=0,
        description="cuBLAS (and cuBLASLt) workspace per stream in KiB, set before the worker's first "
        "cuBLAS call (CUBLAS_WORKSPACE_CONFIG, CUBLASLT_WORKSPACE_SIZE; either variable already in the "
        "environment wins). torch's default on an H100 is 32 MiB for each library and stream (~160 MiB of a "
        "worker, docs/benchmarks.md); decode steps run Triton kernels, so cuBLAS runs only prefill GEMMs, "
        "where split-K matters little. None: torch's default",
    )
    cuda_max_connections: int | None = Field(
        # 1 by default, from the H100: a fresh process's CUDA context beside 8 busy and 30 idle contexts
        # took 804 ms with the driver's 8 connections vs 341 ms with one (bench/context_probe.py); in the
        # 64-function replay the fresh workers' context went from p50 3.2 s to 0.75-1.6 s and the SLO
        # violations from 25% to 12% (docs/benchmarks.md)
        default=1,
        ge=1,
        le=32,
        description="hardware work queues of this worker's CUDA context (CUDA_DEVICE_MAX_CONNECTIONS, set "
        "before the first CUDA call unless already in the environment). Each context on a GPU adds its "
        "queues to the device's run list; with dozens of worker contexts per GPU, fewer queues make a new "
        "context several times faster. A worker runs one stream of work, so it loses no overlap that "
        "matters (a batch job's host KV copies no longer overlap its steps). None: the driver's default (8)",
    )
    spawned_at_ms: int | None = Field(
        default=None, description="unix ms when the process was asked for (a fresh cold start's clock)"
    )
    gpu_admission: bool = Field(
        default=False,
        description="ask the device's prefill slot (cross-function admission by deadline margin); opt-in "
        "until it beats no admission on a GPU (docs/benchmarks.md)",
    )
    decode_gating: bool = Field(
        default=False,
        description="with gpu_admission: while another worker of the device runs an urgent prefill (small "
        "deadline margin), pause this worker's decode steps, each at most its TPOT slack "
        "(docs/scheduler.md); opt-in until measured on a GPU",
    )
    gate_tpot_ms: float = Field(
        default=200.0,
        gt=0,
        description="decode gating: the TPOT SLO that bounds a pause without spec.slo.tpotMs",
    )
    kv_read_cap: bool = Field(
        default=True,
        description="hold no more requests than the KV cache is expected to serve at once (KV tokens / the "
        "moving average of a finished request's prompt + half its completion): the rest stay queued in the "
        "stream, where the controller sees them and other workers of the function can read them "
        "(runtime.read_cap)",
    )
    expected_tokens_prior: float = Field(
        default=DEFAULT_EXPECTED_TOKENS,
        gt=0,
        description="the KV tokens a request holds on average before one has finished",
    )
    gate_urgent_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="decode gating: a prefill grant is urgent when its deadline margin is below this share "
        "of the function's TTFT SLO (never below its own step time); 0: never urgent",
    )
    deadline_order: bool = Field(
        default=True,
        description="serve this worker's pending prefills by TTFT deadline (enqueue time + spec.slo.ttftMs): "
        "earliest first among those that can still make it, the ones predicted late behind them "
        "(docs/scheduler.md#deadline-order); on by default from the CPU evidence (docs/benchmarks.md), "
        "false: first come first served",
    )
    overlap_steps: bool | None = Field(
        default=None,
        description="queue each engine step before reading the previous one back "
        "(EngineConfig.overlap_steps: the host's reading, detokenizing and scheduling then run while the GPU "
        "computes); default: on for CUDA, off on a CPU",
    )
    bid_deadline: Literal["plan", "oldest"] = Field(
        default="plan",
        description="gpu_admission: the deadline a worker bids with for its GPU's prefill budget. plan: of "
        "the first prompt its deadline plan serves on time (a late oldest request, served behind those, does "
        "not win the GPU over another worker's prompt that can still make it), the oldest request's when "
        "none is on time or deadline_order is off; oldest: the oldest waiting request's (the rule before "
        "issue 13, for ablations)",
    )
    batch_hold: bool = Field(
        default=True, description="fill or expire: an idle worker holds its first prefill for companions"
    )
    gpu_prefill_tokens: int = Field(
        default=4096,
        ge=1,
        description="the device's prefill budget (admission): prompt tokens its workers prefill at once "
        "(two full engine steps: a tight function can always start beside one long step)",
    )
    request_log: bool = Field(
        default=True,
        description="log one line per finished request: queued, held, prefill and first-token ms",
    )
    profile_steps: int = Field(
        default=0,
        ge=0,
        description="record the first N engine steps with torch.profiler (kernels and host calls by time, "
        "each step's wall ms, a Chrome trace) into profile_dir: what a new worker's first requests spend",
    )
    profile_dir: str | None = Field(default=None, description="where profile_steps writes (default: cwd)")
    log_level: str = "INFO"


def default_engine(settings: WorkerSettings, record: Any) -> ServingEngine:
    """The real engine: `lorafn.runtime.Engine` on the function's backbone and adapter."""
    from lorafn.runtime import Engine, EngineConfig
    from lorafn.runtime.kv_offload import OffloadConfig

    if settings.device.startswith("cuda"):
        import torch

        # CPU threads matter little to a GPU worker, and many workers on one host oversubscribe it
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
        # before the first cuBLAS call: torch reads these once, when it makes the first workspace; and before
        # the first CUDA call: the driver reads CUDA_DEVICE_MAX_CONNECTIONS when it makes the context
        for name, value in worker_cuda_env(
            settings.cublas_workspace_kib, settings.cuda_max_connections
        ).items():
            os.environ.setdefault(name, value)

    model = settings.model or (record.model_dir if record else "")
    adapter = settings.adapter or (record.adapter_dir if record else "") or None
    if settings.standby:
        adapter = None  # a standby holds no tenant's adapter until it is bound
    slots = settings.adapter_slots
    if slots > 1 and settings.standby and not settings.shape:
        raise ValueError("--adapter-slots: a standby with adapter slots needs --shape (the slots' shape)")
    if not model:
        raise ValueError(f"no model directory for {settings.function}: register the function or pass --model")
    weight_source = None
    pre_runner_s: dict[str, float] = {}  # stages before the runner's own clock starts, for log_startup
    if settings.backbone_socket:
        # The backbone server's copy, mapped read-only: this worker holds no weight bytes of its own.
        from lorafn.backbone_server.client import SharedWeightSource

        if settings.device.startswith("cuda"):
            # made here on its own clock (the attach would make it, inside its attach_seconds)
            pre_runner_s["cuda_context"] = make_cuda_context(settings.device)
        weight_source = SharedWeightSource(settings.backbone_socket, device=settings.device)
        pre_runner_s["backbone_attach"] = weight_source.attach_seconds  # connect, server reply, map
        pre_runner_s["backbone_map"] = weight_source.map_seconds  # of which the mapping
    engine = Engine(
        EngineConfig(
            model=model,
            adapter=adapter if slots == 1 else None,
            adapter_slots=slots,
            adapters=(adapter,) if slots > 1 and adapter else (),
            prefill_graph_tokens=token_buckets(settings.prefill_graph_tokens),
            device=settings.device,
            dtype=settings.dtype,
            max_num_seqs=settings.max_running,
            weight_source=weight_source,
            kv_cache_memory_bytes=settings.kv_budget_mib << 20 if settings.kv_budget_mib else None,
            lora_shape=settings.shape if settings.standby or (slots > 1 and not adapter) else None,
            cuda_stack_bytes=settings.cuda_stack_bytes,
            kv_offload=OffloadConfig(host_budget_bytes=settings.host_kv_mib << 20),
            # a fresh worker serves before its decode graphs are captured; a standby captures them while
            # it waits for a bind anyway
            lazy_graphs=settings.lazy_graphs and not settings.standby,
            # an archive holds one adapter slot's graphs: a slot engine captures its own
            graph_archives=settings.graph_archives and slots == 1,
            graph_archive_dir=settings.graph_archive_dir,
            deadline_order=settings.deadline_order,
            overlap_steps=settings.overlap_steps,
        )
    )
    engine.pre_runner_s = pre_runner_s  # type: ignore[attr-defined]
    return engine


def make_cuda_context(device: str) -> float:
    """Create this process's CUDA context on `device` (torch's lazy init + the primary context); seconds."""
    import torch

    t0 = time.perf_counter()
    dev = torch.device(device)
    if dev.index is not None:
        torch.cuda.set_device(dev.index)
    torch.zeros(1, device=dev)
    return time.perf_counter() - t0


def worker_cuda_env(cublas_workspace_kib: int | None, max_connections: int | None) -> dict[str, str]:
    """The CUDA environment a GPU worker sets for itself before its first CUDA call. Pure."""
    env = cublas_workspace_env(cublas_workspace_kib)
    if max_connections is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(max_connections)
    return env


def cublas_workspace_env(kib: int | None) -> dict[str, str]:
    """The environment that gives cuBLAS and cuBLASLt a `kib` KiB workspace each (per handle and stream,
    as torch allocates them); {} for None (torch's default). Pure."""
    if kib is None:
        return {}
    if isinstance(kib, bool) or not isinstance(kib, int) or kib < 0:
        raise ValueError(f"cublas_workspace_kib: must be an integer >= 0 or None, got {kib!r}")
    return {"CUBLAS_WORKSPACE_CONFIG": f":{kib}:1", "CUBLASLT_WORKSPACE_SIZE": str(kib)}


def _load_factory(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"engine_factory {path!r} must be module:callable")
    return getattr(importlib.import_module(module), attr)


def serve_worker(settings: WorkerSettings) -> int:
    """Build the engine, then run the serving loop until drained, idle or stopped; the exit code."""
    from lorafn.api import FunctionRef, LoRAFunctionSpec
    from lorafn.store.registry import get_function

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if settings.standby:
        from lorafn.runtime.standby import serve_standby

        return serve_standby(settings)
    function = str(FunctionRef.parse(settings.function))
    keys = Keys(settings.key_prefix)
    store = Store(settings.redis_url)
    record = store.run(get_function(keys, function))
    settings = with_registered_backbone(settings, record)
    keep_alive = settings.keep_alive_seconds
    if keep_alive is None and record is not None and record.spec:
        keep_alive = float(LoRAFunctionSpec.model_validate(record.spec).scaling.keep_alive_seconds)
    built_at_ms = time.time() * 1000
    engine = make_engine(settings, record)
    log_startup(engine, settings, built_at_ms)
    # the engine's objects (and the libraries') out of later full collections, which would otherwise walk
    # them inside a request's step (standby.settle_heap; here without the collection itself: O(1), and a
    # fresh worker's first request is already waiting)
    gc.freeze()
    worker = Worker(store, keys, engine, serving_config(settings, function, keep_alive, engine))
    worker.install_signal_handlers()
    if settings.spawned_at_ms:  # a fresh cold start: tell the controller how long it took
        ms = max(0.0, time.time() * 1000 - settings.spawned_at_ms)
        store.run(
            control.post_event(
                keys,
                control.BOUND,
                worker=worker.worker_id,
                function=function,
                ms=round(ms, 1),
                path=control.PATH_FRESH,
            )
        )
    log.info("worker %s serving %s", worker.worker_id, function)
    return worker.run()


def with_registered_backbone(settings: WorkerSettings, record: Any) -> WorkerSettings:
    """The settings of a worker started for a function, its backbone named: the registration's where the
    launcher named none (a fresh local worker gets `--function` only). Its heartbeat carries it
    (`placement_fields`): the controller reads a worker's private weight bytes by it under no sharing and
    the replay counts memory by it; a worker heartbeating no backbone had neither. A launcher that names
    another backbone than the registration is refused (ValueError naming both)."""
    registered = str((record.spec or {}).get("backbone") or "") if record is not None else ""
    if not registered or settings.backbone == registered:
        return settings
    if settings.backbone:
        raise ValueError(
            f"--backbone {settings.backbone!r}: function {settings.function!r} is registered on backbone "
            f"{registered!r}"
        )
    return settings.model_copy(update={"backbone": registered})


def log_startup(engine: Any, settings: WorkerSettings, built_at_ms: float) -> None:
    """One line with where a fresh worker's start went: spawn -> engine set-up (imports, or the fork), the
    stages before the runner that `default_engine` timed (`pre_runner_s`: CUDA context, backbone attach and
    its mapping, with a backbone server), then the engine's stages (`ModelRunner.startup_s`: CUDA context,
    adapter, backbone views, KV cache, decode graphs); docs/benchmarks.md "Fresh worker to first token" is
    read from it."""
    pre = dict(getattr(engine, "pre_runner_s", None) or {})
    stages = dict(getattr(getattr(engine, "runner", None), "startup_s", None) or {})
    now_ms = time.time() * 1000
    parts = []
    if settings.spawned_at_ms:
        parts.append(f"before_engine_ms={max(0.0, built_at_ms - settings.spawned_at_ms):.0f}")
    parts += [f"{k}_ms={v * 1000:.0f}" for k, v in pre.items()]
    parts += [f"{k}_ms={v * 1000:.0f}" for k, v in stages.items()]
    parts.append(f"engine_ms={now_ms - built_at_ms:.0f}")
    log.info("worker start-up %s", " ".join(parts))


def make_engine(settings: WorkerSettings, record: Any) -> ServingEngine:
    factory = _load_factory(settings.engine_factory) if settings.engine_factory else default_engine
    return factory(settings, record)


def placement_fields(settings: WorkerSettings, engine: Any, memory: bool = True) -> dict[str, Any]:
    """Heartbeat fields the controller places by: device, backbone, adapter shape, reservation (bytes).
    Standby and bound workers send the same ones. `memory=False`: the first three only (no NVML read)."""
    fields: dict[str, Any] = {"gpu": settings.gpu, "backbone": settings.backbone or ""}
    shape = getattr(engine, "lora_shape_key", None)
    if shape:
        fields["shape"] = shape
    if not memory:
        return fields
    offload = getattr(engine, "kv_offload_stats", None)
    if callable(offload):  # KV swaps out/in, bytes, recomputes (docs/batch.md)
        fields.update(offload())
    mem = getattr(engine, "reserved_bytes", None)
    if callable(mem):
        fields["mem_bytes"] = int(mem())
    runner = getattr(engine, "runner", None)
    if runner is not None and hasattr(runner, "memory_parts"):
        fields["kv_bytes"], fields["lora_bytes"] = runner.memory_parts()
    budget_mib = settings.kv_budget_mib
    if budget_mib:
        # the grant it was started with: the cache itself is whole blocks (and one fewer, see
        # ModelRunner._num_kv_blocks), so it reports up to a block (8 MiB on a 7B) less than it was given,
        # and a standby judged by that would look too small for the functions it was sized for
        fields["kv_budget_bytes"] = budget_mib << 20
        # the driver's figure for the whole process (context, kernels, workspaces, allocator) where it
        # can be read: the controller learns a worker's real overhead from it
        from lorafn.runtime.gpu_memory import cuda_uuid, device_free_bytes_on, process_bytes_on

        uuid = cuda_uuid(getattr(runner, "device", None))  # once for both readings (None: CPU, no UUID)
        whole = process_bytes_on(uuid) if uuid else None
        if whole is not None:
            fields["mem_bytes"], fields["mem_source"] = max(whole, fields.get("mem_bytes", 0)), "driver"
            # decode graphs still to capture (`lazy_graphs`): the process grows by their pool; until they
            # are captured the controller charges it the learned overhead (controller.policy.charge)
            fields["graphs_pending"] = int(bool(getattr(runner, "graphs_pending", False)))
        free = device_free_bytes_on(uuid) if uuid else None
        if free is not None:  # the device as the driver counts it: the controller's second guard
            fields["device_free_bytes"] = free
    return fields


def serving_config(
    settings: WorkerSettings, function: str, keep_alive: float | None, engine: Any
) -> ServingConfig:
    """The loop's config, with what the controller reads in the heartbeat (device, backbone, shape, size:
    read at each heartbeat, `live_fields`; not here, on the way from a bind to the first request)."""
    fields = placement_fields(settings, engine, memory=False)
    return ServingConfig(
        function=function,
        worker_id=settings.worker_id or default_worker_id(),
        max_running=settings.max_running,
        heartbeat_s=settings.heartbeat_s,
        heartbeat_ttl_s=settings.heartbeat_ttl_s,
        claim_min_idle_ms=settings.claim_min_idle_ms,
        stall_after_ttls=settings.stall_after_ttls,
        keep_alive_s=keep_alive,
        heartbeat_fields=fields,
        batching=BatchingConfig(
            gpu=settings.gpu,
            gpu_admission=settings.gpu_admission,
            decode_gating=settings.decode_gating,
            gate_tpot_ms=settings.gate_tpot_ms,
            urgent_fraction=settings.gate_urgent_fraction,
            bid_deadline=settings.bid_deadline,
            batch_hold=settings.batch_hold,
            prefill_tokens=settings.gpu_prefill_tokens,
            backbone=settings.backbone or "",
            gpu_model=gpu_model_name(settings.device),
            shape=fields.get("shape", ""),
        ),
        live_fields=lambda: placement_fields(settings, engine),
        kv_read_cap=settings.kv_read_cap,
        expected_tokens_prior=settings.expected_tokens_prior,
        request_log=settings.request_log,
        profile_steps=settings.profile_steps,
        profile_dir=settings.profile_dir,
    )


@app.command("serve")
def serve(
    function: str = typer.Option(None, "--function", "-f", help="namespace/name (env LORAFN_FUNCTION)"),
    redis_url: str = typer.Option(None, "--redis-url", help="env LORAFN_REDIS_URL"),
    model: str = typer.Option(None, "--model", help="backbone model dir (default: from the registry)"),
    adapter: str = typer.Option(None, "--adapter", help="adapter dir (default: from the registry)"),
    device: str = typer.Option(None, "--device", help="cpu | cuda | cuda:N"),
    worker_id: str = typer.Option(None, "--worker-id"),
    keep_alive_seconds: float = typer.Option(None, "--keep-alive-seconds"),
    engine_factory: str = typer.Option(None, "--engine-factory", help="module:callable (tests, benchmarks)"),
    standby: bool = typer.Option(
        None, "--standby", help="start tenant-neutral (backbone mapped, KV allocated) and wait for a bind"
    ),
    backbone: str = typer.Option(None, "--backbone", help="backbone of a standby worker"),
    gpu: str = typer.Option(None, "--gpu", help="the controller's device id (e.g. local/0)"),
    shape: str = typer.Option(None, "--shape", help="adapter shape a standby prepares (q_proj:16,v_proj:16)"),
    kv_budget_mib: int = typer.Option(
        None, "--kv-budget-mib", help="KV-cache budget granted by the controller"
    ),
    adapter_slots: int = typer.Option(
        None, "--adapter-slots", help="adapters one batch serves: functions of one namespace share the worker"
    ),
) -> None:
    """Serve one function (--function), or wait as a standby (--standby --backbone B) until bound to one:
    read its request stream, run the engine, stream replies; SIGTERM drains."""
    overrides = {k: v for k, v in locals().items() if v is not None}
    try:
        settings = WorkerSettings(**overrides)
        if settings.standby and not settings.backbone:
            raise ValueError("--standby needs --backbone (or LORAFN_BACKBONE)")
        if settings.standby and settings.function:
            raise ValueError("--standby and --function exclude each other: a standby is bound later")
        if not settings.standby and not settings.function:
            raise ValueError("--function (or LORAFN_FUNCTION) is required, or --standby --backbone B")
        code = serve_worker(settings)
    except ValueError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=2) from None
    raise typer.Exit(code=code)
