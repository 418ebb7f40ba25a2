"""Standby workers: tenant-neutral processes that wait, fully warmed, for `bind(function)`.

A standby has done everything a cold start would otherwise wait for: libraries imported, CUDA context
up, the backbone mapped read-only, its KV cache allocated from the budget the controller granted, and,
when the controller named an adapter shape, zeroed LoRA buffers of that shape with the decode graphs
captured over them. It heartbeats as `state=standby` (no function) and blocks on its control stream.

`bind(function)` (a control command from the controller): read the function's registration, check it
is on this worker's backbone, load the adapter into the prepared buffers (a copy: the graphs stay valid;
an adapter of another shape is loaded fresh and the graphs are captured again), tell the controller
(`bound`, with the milliseconds it took) and become that function's worker: the ordinary serving loop
(`lorafn.runtime.worker.Worker`) from then on. A bound worker never returns to the pool (one tenant per
process); the controller starts a fresh standby in its place.

`preload(function)` (a control command; DESIGN idea 4): load that function's adapter into the prepared
buffers now and stay a standby, heartbeating `preloaded=<function>`. A later bind to that function finds its
adapter in place (the files unchanged since) and is registration only; a bind to another function
overwrites every buffer first (`copy_lora` zeroes and copies each one; an adapter that does not fit them is
loaded fresh and the buffers are zeroed before they are dropped), so nothing of a pre-loaded adapter
reaches another tenant's requests.

With `claim=1` on the preload (the controller's `preload_claims`, on by default) the standby also takes
the function's first request itself: it builds the function's serving loop ahead (consumer group, SLO,
latency profile: round trips that are then not in the cold start), and waits on its control stream and the
function's request stream in one blocking read. A request wakes it as fast as it wakes a bound worker; it
then registers as the function's worker in one atomic step that succeeds only while the function has no
other live worker (`workers.heartbeat(only_if_alone=True)`: of several racers one wins, and a function
that has a worker keeps it), and serves, with no bind round through the controller. The controller decided
this when it chose the pre-load (it placed the function there); a control command read in the same wake
(a bind elsewhere, another pre-load, a stop) goes first. The requests themselves are read with the
consumer group as always, so one the standby is too late for is served by whoever has it.

A bind that fails (the adapter is unreadable or does not fit the backbone) is reported (`bind_failed`, with
the reason) and the process exits 3: it may hold part of a tenant's adapter, so it is not reused either.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from lorafn.store import UNAVAILABLE_ERRORS, Keys, Op, Store, combine, control, streams, workers

log = logging.getLogger("lorafn.worker")

EXIT_BIND_FAILED = 3
# how long a bound standby's serving loop waits before its first sweep for requests of dead workers (a
# round trip that would otherwise come between its first read and its first prefill)
FIRST_CLAIM_DEFER_S = 0.5


class Standby:
    """The waiting part of a standby worker's life. `wait()` returns the function to serve, or None."""

    def __init__(self, store: Store, keys: Keys, settings: Any, engine: Any, worker_id: str) -> None:
        self.store, self.keys, self.settings, self.engine, self.worker_id = (
            store,
            keys,
            settings,
            engine,
            worker_id,
        )
        # only commands sent after this process started (a restarted pod keeps its worker id)
        self._cursor = store.run(workers.last_control_id(keys, worker_id))
        self._stopping = False
        self._started = time.time()
        # (function, adapter dir, file stamps) whose adapter the prepared buffers hold, or None
        self._preloaded: tuple[str, str, tuple[tuple[int, int], ...]] | None = None
        self.bound_preloaded = False  # the bind found the function's adapter pre-loaded
        # with a claiming pre-load: the pre-loaded function's request stream is watched after this id, and
        # its serving loop is built ahead ((function, spec it was built from, the Worker))
        self._watch_after: str | None = None
        self._ready: tuple[str, Any, Any] | None = None
        self._claimed: Any = None  # the registration read when it took its function's first request
        self.claimed = False  # it took the first request itself (no bind command)
        self.claim_marks: dict[str, float] = {}

    def stop(self, *_: Any) -> None:
        self._stopping = True

    @property
    def cursor(self) -> str:
        """The last control command read (the bind): the bound worker goes on from there."""
        return self._cursor

    def fields(self, state: str, memory: bool = True) -> dict[str, Any]:
        """Heartbeat fields; `memory=False` leaves out the reservation (no NVML read: see `bind`)."""
        from lorafn.runtime.worker import placement_fields

        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "state": state,
            "running": 0,
            "started": int(self._started),
            "preloaded": self._preloaded[0] if self._preloaded and state == "standby" else "",
            **placement_fields(self.settings, self.engine, memory=memory),
        }

    def _beat_op(
        self, state: str, function: str | None, memory: bool = True, only_if_alone: bool = False
    ) -> Op[Any]:
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        fields = self.fields(state, memory)
        return workers.heartbeat(self.keys, self.worker_id, function, ttl_ms, fields, only_if_alone)

    def _beat(self, state: str = "standby", function: str | None = None, store: Store | None = None) -> None:
        (store or self.store).run(self._beat_op(state, function))

    def wait(self) -> str | None:
        """Heartbeat and read the control stream until a `bind` (its function), a request of the function it
        pre-loaded with `claim=1` that it could take (that function), or a `stop` (None)."""
        block_ms = int(self.settings.heartbeat_s * 1000)
        log.info(
            "standby %s ready (backbone %s, shape %s)",
            self.worker_id,
            self.settings.backbone,
            self.settings.shape,
        )
        while not self._stopping:
            watched = self._watched()
            try:
                self._beat()
                if watched is None:
                    read = workers.read_control(self.keys, self.worker_id, self._cursor, block_ms)
                    commands, arrived = self.store.run(read), None
                else:
                    after = self._watch_after or "0-0"
                    commands, arrived = self.store.run(
                        workers.read_control_or_requests(
                            self.keys, self.worker_id, self._cursor, watched, after, block_ms
                        )
                    )
            except UNAVAILABLE_ERRORS as e:
                log.warning("standby %s: Redis unreachable (%s); retrying", self.worker_id, e)
                time.sleep(1.0)
                continue
            for entry_id, body in commands:  # the controller's word first
                self._cursor = entry_id
                cmd = body.get("cmd")
                if cmd in ("stop", "drain"):
                    return None
                if cmd == "bind" and body.get("function"):
                    return body["function"]
                if cmd == "preload" and body.get("function"):
                    self._preload_logged(body["function"], claim=body.get("claim") == "1")
                    continue
                log.warning("standby %s: ignoring control command %r", self.worker_id, body)
            if arrived is not None and watched is not None and self._watched() == watched:
                self._watch_after = arrived
                # unix ms: the request's enqueue (its entry id), this wake-up, the claim's answer
                self.claim_marks = {"enqueued": streams.entry_ms(arrived), "woke": time.time() * 1000}
                try:
                    if self._claim(watched):
                        self.claim_marks["claimed"] = time.time() * 1000
                        return watched
                except UNAVAILABLE_ERRORS as e:
                    log.warning("standby %s: Redis unreachable (%s); retrying", self.worker_id, e)
        return None

    def _watched(self) -> str | None:
        """The function whose request stream the standby watches (a claiming pre-load), or None."""
        return self._preloaded[0] if self._preloaded is not None and self._watch_after is not None else None

    def _claim(self, function: str) -> bool:
        """Register as `function`'s worker if it has no other live worker, reading its registration in the
        same round trip; whether it did (then `bind` needs no round trip of its own)."""
        from lorafn.store.registry import get_function

        took, record = self.store.run(
            combine(
                self._beat_op("binding", function, memory=False, only_if_alone=True),
                get_function(self.keys, function),
            )
        )
        if not took:
            log.debug("standby %s: %s has a worker; not taking its request", self.worker_id, function)
            return False
        self._claimed, self.claimed = record, True
        return True

    def _preload_logged(self, function: str, claim: bool = False) -> None:
        self._watch_after, self._ready = None, None  # nothing of an earlier pre-load's claim is kept
        try:
            # the stream's end before the pre-load: a request arriving while it runs still wakes the claim
            after = self.store.run(streams.last_request_id(self.keys, function)) if claim else None
            ms = self.preload(function)
            if claim:
                ms += self._get_ready(function)
                self._watch_after = after
        except (ValueError, OSError) as e:  # the standby stays usable: only this pre-load is lost
            log.warning("standby %s: pre-load of %s failed: %s", self.worker_id, function, e)
            self._watch_after, self._ready = None, None
            return
        log.info(
            "standby %s pre-loaded the adapter of %s in %.1f ms%s",
            self.worker_id, function, ms, " (takes its first request)" if claim else "",
        )  # fmt: skip
        gc.freeze()  # what the pre-load made stays out of later collections too (O(1), see settle_heap)

    def _get_ready(self, function: str) -> float:
        """For a claiming pre-load: build `function`'s serving loop (its round trips: consumer group, SLO and
        latency profile); the ms it took."""
        t0 = time.perf_counter()
        record = self._record(function)
        worker = self._new_worker(function, record)
        worker.prepare(record)
        self._ready = (function, record.spec, worker)
        return (time.perf_counter() - t0) * 1000

    def _new_worker(self, function: str, record: Any) -> Any:
        from lorafn.api import LoRAFunctionSpec
        from lorafn.runtime.worker import Worker, serving_config

        keep_alive = self.settings.keep_alive_seconds
        if keep_alive is None:
            keep_alive = float(LoRAFunctionSpec.model_validate(record.spec).scaling.keep_alive_seconds)
        config = serving_config(self.settings, function, keep_alive, self.engine)
        return Worker(self.store, self.keys, self.engine, config)

    def worker(self, function: str, record: Any) -> Any:
        """The serving loop for `function` after its bind: the one built ahead when it was pre-loaded with
        a claim and its registration has not changed since, else a new one."""
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] == function and ready[1] == record.spec:
            return ready[2]
        return self._new_worker(function, record)

    def preload(self, function: str) -> float:
        """Load `function`'s adapter into the prepared buffers, staying a standby; the milliseconds it took.
        ValueError when the function is unknown, on another backbone, or its adapter does not fit the
        buffers (only a bind may replace them)."""
        t0 = time.perf_counter()
        record = self._record(function)
        runner = getattr(self.engine, "runner", None)
        if runner is None or not getattr(runner, "prepared", False) or runner.lora is None:
            raise ValueError("this standby has no prepared LoRA buffers to pre-load into")
        if runner.num_adapter_slots > 1:
            raise ValueError("a standby with adapter slots is not pre-loaded (its bind fills slot 0)")
        from lorafn.runtime.lora import copy_lora, fits_shape, load_lora

        loaded = load_lora(record.adapter_dir, runner.model_config, runner.device, runner.dtype)
        if not fits_shape(loaded, runner.lora):
            raise ValueError(
                f"adapter shape {loaded.shape_key!r} of {function} does not fit the buffers' "
                f"{runner.lora.shape_key!r}"
            )
        self._preloaded = None  # while the copy runs the buffers hold neither adapter
        copy_lora(runner.lora, loaded)  # zeroes and overwrites every buffer
        self._preloaded = (function, record.adapter_dir, _stamp(record.adapter_dir))
        self._beat()  # the controller sees it at once (it plans binds by it)
        return (time.perf_counter() - t0) * 1000

    def bind(self, function: str) -> tuple[Any, float]:
        """Load the function's adapter: (its registration record, bind ms); ValueError on failure."""
        t0 = time.perf_counter()
        record, self._claimed = self._claimed, None
        if record is None or not self.claimed:
            # One round trip: the heartbeat that makes it the function's (for the controller too) and the
            # function's record. Without the memory fields: they would read the driver's process list (NVML,
            # milliseconds on an H100, inside the cold start); the hash keeps the last standby beat's figures.
            # (A claim did both already.)
            from lorafn.store.registry import get_function

            _, record = self.store.run(
                combine(self._beat_op("binding", function, memory=False), get_function(self.keys, function))
            )
        if record is not None and self._holds(function, record.adapter_dir):
            return self._bind(function, t0, record)  # registration only: no time for a heartbeat to lapse
        # Loading a big adapter (or capturing graphs for a new shape) can outlast the heartbeat TTL: keep
        # beating from a thread, or the controller sees no worker and starts a second one.
        done = threading.Event()
        beater = threading.Thread(
            target=self._beat_until, args=(done, function), name="bind-heartbeat", daemon=True
        )
        beater.start()
        try:
            return self._bind(function, t0, record)
        finally:
            done.set()
            beater.join(timeout=self.settings.heartbeat_s + 5)

    def _beat_until(self, done: threading.Event, function: str) -> None:
        store = Store(self.store.url)
        try:
            while not done.wait(self.settings.heartbeat_s):
                with contextlib.suppress(*UNAVAILABLE_ERRORS):
                    self._beat("binding", function, store)
        finally:
            store.close()

    def _record(self, function: str, record: Any = None) -> Any:
        """The function's registration (read unless given), checked to run on this standby's backbone
        (ValueError if not)."""
        from lorafn.api import LoRAFunctionSpec
        from lorafn.store.registry import get_function

        if record is None:
            record = self.store.run(get_function(self.keys, function))
        if record is None:
            raise ValueError(f"function {function} is not registered")
        spec = LoRAFunctionSpec.model_validate(record.spec)
        if spec.backbone != self.settings.backbone:
            raise ValueError(
                f"function {function} runs on backbone {spec.backbone!r}; "
                f"this standby holds {self.settings.backbone!r}"
            )
        if not record.adapter_dir:
            raise ValueError(f"function {function} has no adapter directory")
        return record

    def _holds(self, function: str, adapter_dir: str) -> bool:
        """Whether the prepared buffers hold `function`'s adapter, its files unchanged since the pre-load."""
        return self._preloaded == (function, adapter_dir, _stamp(adapter_dir))

    def _bind(self, function: str, t0: float, record: Any) -> tuple[Any, float]:
        record = self._record(function, record)
        t_record = time.perf_counter()
        fits = self._holds(function, record.adapter_dir)
        self._preloaded = None
        runner = getattr(self.engine, "runner", None)
        if getattr(self.engine, "num_adapter_slots", 1) > 1:
            # adapter slots (docs/runtime.md#adapter-slots): the function takes slot 0, the others stay empty
            # for the functions that join it later
            how = self.engine.load_adapter(0, record.adapter_dir)
            if runner is not None:
                runner.prepared = False
        elif fits:
            runner.prepared = False  # the buffers hold this function's adapter: they are its own now
            how = "pre-loaded"
            self.bound_preloaded = True
        else:
            if runner is not None and getattr(runner, "prepared", False) and runner.lora is not None:
                from lorafn.runtime.lora import clear_lora

                # another function's pre-loaded adapter (or part of one, if its copy failed): nothing of it
                # may stay, whether the new adapter is copied over the buffers or replaces them
                clear_lora(runner.lora)
            how = self.engine.bind_adapter(record.adapter_dir)
        t_done = time.perf_counter()
        ms = (t_done - t0) * 1000
        log.info(
            "standby %s bound to %s in %.1f ms (registration %.1f ms, adapter %.1f ms: %s)",
            self.worker_id, function, ms, (t_record - t0) * 1000, (t_done - t_record) * 1000, how,
        )  # fmt: skip
        return record, ms


def _stamp(adapter_dir: str) -> tuple[tuple[int, int], ...]:
    """(mtime ns, size) of an adapter's two files: a pre-loaded adapter is used only while they match."""
    from pathlib import Path

    out = []
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        try:
            st = (Path(adapter_dir) / name).stat()
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((0, -1))
    return tuple(out)


# Prompt lengths a GPU standby prefills before it waits. cuBLAS picks its GEMM kernels by the row count
# (each new kernel is loaded lazily, on its first launch) and flash attention has variants for lengths that
# are not multiples of its tile, so a warm-up at one aligned length (the earlier 16 and 512 tokens) left
# the first request's own length to load kernels inside its TTFT. These span the magnitudes a prompt has,
# aligned and not; the step budget and a chunked prompt just beyond it are added where the KV budget holds
# them. About 7k tokens in all: ~0.2 s of an H100 for a 7B backbone, before the standby waits.
WARM_PROMPT_LENGTHS = (16, 40, 100, 250, 512, 777, 1300, 2048)


def warm_up_lengths(capacity: int, max_len: int, step_tokens: int, gpu: bool) -> list[int]:
    """The prompt lengths `warm_up` prefills, one at a time: each fits `capacity` (tokens the KV budget
    holds) and `max_len` (the model's), with room for a few generated tokens. On a GPU the spread of
    `WARM_PROMPT_LENGTHS`, the step budget `step_tokens` and one chunked prompt beyond it; on CPU (no lazy
    kernel loading) one short prompt: its forward takes the first-forward costs (a 37-token request's
    prefill 287 -> 170 ms on the 2-core VM, SmolLM2-135M), and a 512-token prompt and the mixed steps after it
    made no later request faster (300-token prompt, two prompts at once: the same first time and after)
    while they took the warm-up from 0.2 to 2.0 s of all the host's cores, beside whatever a request ran
    there. Pure."""
    limit = min(capacity, max_len) - 8
    if limit < 1:
        return []
    if not gpu:
        return [min(16, limit)]
    wanted = {*WARM_PROMPT_LENGTHS, step_tokens, step_tokens + 17}
    return sorted({n for n in wanted if n <= limit} or {limit})


def warm_up(engine: Any, max_prompt_tokens: int | None = None, mixed: bool | None = None) -> float:
    """Run the forwards a first request can need before the standby waits, so that none of their one-time
    costs lands inside a request's TTFT: prompts of the lengths `warm_up_lengths` names, each with a
    decode step (the decode graph of one sequence); then (``mixed``; default: on a GPU only) two prompts
    prefilled in one step and a prompt prefilled beside running decodes (the eager mixed step). On CUDA
    each first forward of a kind loads its kernels (lazily) and grows the allocator's pool; on CPU only
    the first forward has such costs (`warm_up_lengths`). The prepared LoRA buffers (zeros) are in place,
    so the LoRA kernels of the prepared shape (its rank is a compile-time constant of the Triton expands)
    are the ones warmed. `max_prompt_tokens` caps the lengths (tests). Returns the seconds it took (0 for
    engines without `generate`, e.g. the tests' fakes)."""
    if not hasattr(engine, "generate") or not hasattr(engine, "runner"):
        return 0.0
    from lorafn.runtime.sampling_params import SamplingParams

    t0 = time.perf_counter()
    capacity = engine.runner.num_blocks * engine.config.block_size  # tokens the KV budget holds
    gpu = getattr(engine.runner.device, "type", "cpu") == "cuda"
    lengths = warm_up_lengths(capacity, engine.max_model_len, engine.config.max_num_batched_tokens, gpu)
    if max_prompt_tokens is not None:
        lengths = sorted({min(n, max_prompt_tokens) for n in lengths})
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for n in lengths:  # one at a time: each must fit the KV budget alone
        engine.generate([[1] * n], params)
    if (gpu if mixed is None else mixed) and capacity >= 256:  # two prefills in one step, then a third
        # prefilled beside their decodes
        longer = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        engine.add_request([1] * 17, longer)
        engine.add_request([1] * 33, longer)
        engine.step()
        engine.add_request([1] * 65, params)
        while engine.has_unfinished():
            engine.step()
    seconds = time.perf_counter() - t0
    log.info("standby warmed up in %.2f s (prompts of %s tokens)", seconds, lengths)
    return seconds


def settle_heap() -> float:
    """A full garbage collection, then `gc.freeze()`: every object alive now (torch, the engine, the
    tokenizer, ~200k of them) moves to the permanent generation, which later collections skip. Without
    it the first full collection after the warm-up walked them all inside some request's step: 230-255 ms
    on the CPU VM for 197k objects (measured), and the warm-up had just made the most objects since the
    last one, so a request soon after the bind was the likely victim. Returns the ms it took (not on
    any request's path: before the standby reports ready)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return (time.perf_counter() - t0) * 1000


def serve_standby(settings: Any) -> int:
    """`lorafn worker serve --standby`: warm up, wait for a bind, then serve the function; the exit code."""
    from lorafn.runtime.worker import default_worker_id, make_engine

    keys = Keys(settings.key_prefix)
    store = Store(settings.redis_url)
    worker_id = settings.worker_id or default_worker_id()
    settings = settings.model_copy(update={"worker_id": worker_id})  # the serving loop's id is the same
    from lorafn.store.backbones import get_backbone

    backbone = store.run(get_backbone(keys, settings.backbone))
    if backbone is None and not settings.model:
        raise ValueError(f"backbone {settings.backbone!r} is not registered (and no --model was given)")
    if not settings.model:
        settings = settings.model_copy(update={"model": backbone.model_dir})
    engine = make_engine(settings, None)
    warm_up(engine)
    log.info("heap settled in %.0f ms (%d objects frozen)", settle_heap(), gc.get_freeze_count())
    standby = Standby(store, keys, settings, engine, worker_id)
    signal.signal(signal.SIGTERM, standby.stop)
    signal.signal(signal.SIGINT, standby.stop)
    function = standby.wait()
    if function is None:
        with contextlib.suppress(*UNAVAILABLE_ERRORS):
            store.run(workers.deregister(keys, worker_id, None))
        log.info("standby %s stopped without being bound", worker_id)
        return 0
    try:
        record, ms = standby.bind(function)
    except (ValueError, OSError) as e:
        log.error("standby %s: bind to %s failed: %s", worker_id, function, e)
        with contextlib.suppress(*UNAVAILABLE_ERRORS):
            store.run(
                control.post_event(
                    keys, control.BIND_FAILED, worker=worker_id, function=function, reason=str(e)
                )
            )
            store.run(workers.deregister(keys, worker_id, None))
        return EXIT_BIND_FAILED
    worker = standby.worker(function, record)
    worker.continue_control_after(standby.cursor)
    worker.registered = True  # its bind or claim heartbeat registered it under the function
    worker.install_signal_handlers()
    # the dead-worker sweep (a round trip) after the cold request's first read and prefill, not before
    worker.defer_first_claim_s = FIRST_CLAIM_DEFER_S
    bound = control.post_event(
        keys,
        control.BOUND,
        worker=worker_id,
        function=function,
        ms=round(ms, 1),
        path=control.PATH_STANDBY,
        preloaded=int(standby.bound_preloaded),
        claimed=int(standby.claimed),
    )
    worker.send_with_next(bound, record)  # with the first read: no round trip of its own in the cold start
    log.info("worker %s serving %s", worker_id, function)  # the same line a fresh worker logs
    if standby.claimed and standby.claim_marks:
        m, now = standby.claim_marks, time.time() * 1000
        log.info(
            "standby %s took the request of %s: woke %.1f ms after its enqueue, claim %.1f ms, "
            "bind and loop set-up %.1f ms",
            worker_id, function, m["woke"] - m["enqueued"], m["claimed"] - m["woke"], now - m["claimed"],
        )  # fmt: skip
    return worker.run()
