"""The Engine: one worker's requests, scheduler, sampler and detokenizers, one step at a time.

All GPU work (the model + adapter, the paged KV cache, CUDA graphs) is the `ModelRunner`'s
(model_runner.py); the engine never touches a model tensor.

Data flow of one `step()`:
  1. `Scheduler.schedule()` plans the step: decodes, then partial prefills, then new requests, under
     the token budget (pure policy, scheduler.py).
  2. `ModelRunner.execute()` runs the plan as one forward (one flattened batch, or the replay of a
     decode CUDA graph) and returns the logits of the chunks that sample.
  3. Logits of the chunks that sample (a decode, or a prompt's last chunk) -> `sample()`; the tokens
     start their copy to the host, and `Scheduler.update()` advances the sequences with placeholders
     (`PENDING_TOKEN`) for them (`_launch`).
  4. The tokens are read back (the step's one wait for the device) over their placeholders; each goes
     through the request's detokenizer + stop checker, which yields the text delta and maybe a finish
     reason (`_read_back`).

Overlapped steps (`EngineConfig.overlap_steps`, on for CUDA): step n is queued (1-3) before step n-1 is read
back (4), so the host's work of both runs while the GPU computes step n. Step n's inputs at positions whose
tokens step n-1 sampled take them on the device (`PendingTokens`, `ModelRunner.execute`); a request whose
`max_tokens` or `max_model_len` its step n-1 token reaches leaves the scheduler at 3, before step n is
planned; one that ends on a stop token or string is found at 4, after step n was queued with a row for it,
whose token is dropped. Without overlap, 4 follows 3 in the same `step()`: the same code, the same tokens.

A step whose plan preempts by swap or re-admits a swapped sequence first copies those KV blocks to host
memory / back (`KVCache.swap_out` / `swap_in`, swap-outs first), before the forward; the host copies live
in `_host_kv` until swapped in or until their request ends. The swap-or-recompute choice is the
scheduler's `OffloadPolicy` (kv_offload.py), whose per-token prefill cost the engine measures here from
its own prefill steps.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lorafn.api.tokenizer import TextTokenizer
from lorafn.runtime.block_manager import blocks_for_tokens
from lorafn.runtime.config import EngineConfig, ModelConfig
from lorafn.runtime.detokenizer import IncrementalOutput
from lorafn.runtime.kv_cache import block_bytes, blocks_for_budget
from lorafn.runtime.kv_offload import OffloadPolicy
from lorafn.runtime.model_runner import ModelRunner, PendingTokens, resolve_dtype
from lorafn.runtime.outputs import ParkRefused, RequestOutput, StreamDelta
from lorafn.runtime.sampling import make_generator, sample
from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from lorafn.runtime.sequence import Sequence as Seq

log = logging.getLogger(__name__)


# The host's copy of a token sampled by a step still queued on the device (overlapped steps): the step
# that reads it back writes the real one in its place. Negative, so a use that skipped the device copy
# fails loudly.
PENDING_TOKEN = -1


@dataclass
class _Request:
    seq: Seq
    output: RequestOutput
    incremental: IncrementalOutput
    generator: torch.Generator | None


def _sequences(out: SchedulerOutput) -> tuple[int, int]:
    """(prefill, decode) sequences of a step: what the worker's latency profile keys its times by."""
    return (len(out.chunks) - out.num_decodes, out.num_decodes)


class _StepTimer:
    """How long a step's forward and sampling took on the device: CUDA events around them (the host does not
    wait for them), or the host's clock on a CPU (where they run on the host)."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        self._seconds: float | None = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._t0

    def seconds(self) -> float:
        """Only after the step's tokens were read back (the end event has happened)."""
        if self._events is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1000
        return self._seconds or 0.0


@dataclass
class _Launched:
    """A step queued on the device whose sampled tokens are not read back yet. ``reqs``: the requests of the
    chunks that sample, in their order; ``where``: seq_id -> (position of its placeholder, row of ``tokens``);
    ``host``: the tokens' copy to host memory, complete once ``ready`` has happened; ``at_max_len``: requests
    whose new token fills ``max_model_len`` (they end with it, "length"); ``timer``: set for a step that
    teaches the prefill cost (`OffloadPolicy.observe_prefill`) of its tokens."""

    out: SchedulerOutput
    reqs: list[_Request]
    where: dict[str, tuple[int, int]]
    tokens: torch.Tensor | None
    host: torch.Tensor | None
    ready: torch.cuda.Event | None
    at_max_len: set[str]
    timer: _StepTimer | None

    def pending(self, live: dict[str, _Request]) -> PendingTokens | None:
        """Its tokens for the next step's inputs, of the requests still ``live`` (an aborted request's id may
        be reused by a new request: its positions are not the old one's)."""
        if self.tokens is None:
            return None
        where = {sid: e for sid, e in self.where.items() if live.get(sid) is self.reqs[e[1]]}
        return PendingTokens(self.tokens, where)


class Engine:
    """`generate` for batches, `add_request` + `step` for a serving loop, `stream` for one request."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {config.device!r} but CUDA is not available here")
        self.dtype = resolve_dtype(config.dtype, self.device)
        model_dir = Path(config.model)
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        limit = (
            mc.max_position_embeddings
            if mc.sliding_window is None
            else min(mc.max_position_embeddings, mc.sliding_window)
        )
        self.max_model_len = min(config.max_model_len or limit, limit)

        # tokenizer.json through `tokenizers`, as the gateway reads it: AutoTokenizer cost 2.9 s of a start
        self.tokenizer = TextTokenizer(config.tokenizer or model_dir)
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)

        self.runner = ModelRunner(config, mc, self.device, self.dtype, self.max_model_len)
        self.offload = OffloadPolicy(config.kv_offload, block_bytes(mc, config.block_size, self.dtype))
        self._host_kv: dict[str, torch.Tensor] = {}  # seq_id -> its swapped-out KV (KVCache.swap_out)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                block_size=config.block_size,
                num_blocks=self.runner.num_blocks,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_model_len=self.max_model_len,
                deadline_order=config.deadline_order,
            ),
            self.offload,
        )
        self.runner.capture_graphs(blocks_for_tokens(self.scheduler.max_model_len, config.block_size))
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.last_step: tuple[int, int] = (0, 0)  # (prefill, decode) sequences of the last step
        # ... of the step the last `step()` read back (the one before `last_step` with overlapped steps, whose
        # wait that call's time is; None when it read none back)
        self.last_read_step: tuple[int, int] | None = None
        self.last_prefill_tokens = 0  # prompt (or recompute) tokens the last step prefilled
        overlap = config.overlap_steps
        self.overlap_steps = self.device.type == "cuda" if overlap is None else overlap
        self._inflight: _Launched | None = None  # overlapped steps: the step queued, not read back yet
        self._ready: list[StreamDelta] = []  # deltas of a step read back outside `step` (`_drain`)

    # ------------------------------------------------------------------ requests

    def bind_adapter(self, adapter_dir: str | Path) -> str:
        """A standby becomes a function's engine: its adapter goes in (no request may be running)."""
        if self._requests:
            raise ValueError("bind_adapter: the engine is running requests")
        self._drain()
        return self.runner.bind_adapter(adapter_dir)

    @property
    def num_adapter_slots(self) -> int:
        """How many adapters one batch of this engine serves (EngineConfig.adapter_slots)."""
        return self.runner.num_adapter_slots

    def load_adapter(self, slot: int, adapter_dir: str | Path | None) -> str:
        """Put an adapter into one adapter slot (None: empty it) while other slots keep serving; refused
        while a request of that slot is queued or running."""
        busy = [r for r, req in self._requests.items() if req.seq.adapter_slot == slot]
        if busy:
            raise ValueError(f"load_adapter: adapter slot {slot} has {len(busy)} requests (e.g. {busy[0]!r})")
        self._drain()  # a dropped row of an ended request of the slot may still read it
        return self.runner.load_adapter(slot, adapter_dir)

    @property
    def lora_shape_key(self) -> str | None:
        """The adapter shape the engine holds (or, in a standby, has buffers for)."""
        return self.runner.lora.shape_key if self.runner.lora is not None else None

    def reserved_bytes(self) -> int:
        return self.runner.reserved_bytes()

    # ------------------------------------------------------------------ parking (docs/runtime.md#parking)

    @property
    def parked(self) -> bool:
        """Parked: no KV cache, no decode graphs; requests are refused until `unpark`."""
        return self.runner.parked

    def park(self) -> int:
        """Release the KV cache and decode graphs of an idle engine (the process, its CUDA context, the
        backbone mapping, the adapter, the tokenizer and the learned costs stay); the bytes released.
        Idempotent. Raises ParkRefused (its message the reason) while a request is unfinished, a swapped-out
        KV copy is held or a block is in use, and with graph archives."""
        if self.runner.parked:
            return self.runner.park()  # the first park's answer
        self._drain()
        busy = []
        if self._requests or self.scheduler.has_unfinished():
            held = self.scheduler.num_waiting + self.scheduler.num_running
            busy.append(f"{max(len(self._requests), held)} requests")
        if self._host_kv:
            busy.append(f"{len(self._host_kv)} swapped-out KV copies")
        used = self.scheduler.block_manager.num_used_blocks
        if used:
            busy.append(f"{used} KV blocks in use")
        if busy:
            raise ParkRefused("busy: " + ", ".join(busy))
        return self.runner.park()

    def unpark(self) -> int:
        """A parked engine serves again: a KV cache of the same blocks, every block free, the decode graphs
        captured lazily. The KV bytes; an unparked engine is left as it is (the same answer)."""
        if not self.runner.parked:
            return self.runner.unpark()
        kv_bytes = self.runner.unpark()
        self.scheduler.reset_blocks()
        return kv_bytes

    def park_release_bytes(self) -> int:
        """What `park` frees now; parked: what `unpark` takes back (`ModelRunner.park_release_bytes`)."""
        return self.runner.park_release_bytes()

    # ------------------------------------------------------------------ KV size (docs/runtime.md)

    @property
    def kv_block_bytes(self) -> int:
        return block_bytes(self.model_config, self.config.block_size, self.dtype)

    def kv_blocks_for(self, kv_bytes: int) -> int:
        """The usable blocks a KV budget of ``kv_bytes`` holds (one more is the scratch), as at start."""
        return max(0, blocks_for_budget(kv_bytes, self.kv_block_bytes) - 1)

    def kv_capacity_tokens(self) -> int:
        """Token positions the KV cache holds (0 parked): what the worker bounds the requests it holds by."""
        return 0 if self.runner.parked else self.scheduler.block_manager.capacity_tokens

    def resize_kv(self, kv_bytes: int) -> int:
        """Resize the KV cache to the budget ``kv_bytes`` while requests run (a grant of more KV for an
        offline batch, or its return): the blocks in use keep their contents and ids; a larger cache adds
        free blocks, a smaller one drops free ones. Returns the new KV bytes. Raises ParkRefused (the
        message the reason) while parked, with graph archives, when a block in use is above the new size,
        or when the longest sequence the scheduler admits would no longer fit alone."""
        num_blocks = self.kv_blocks_for(kv_bytes)
        longest = blocks_for_tokens(self.scheduler.max_model_len, self.config.block_size)
        if num_blocks < longest:
            raise ParkRefused(
                f"kv_bytes: {kv_bytes} holds {num_blocks} blocks, less than one sequence of max_model_len "
                f"{self.scheduler.max_model_len} needs ({longest})"
            )
        if self.runner.parked:
            raise ParkRefused("parked")
        self._drain()
        manager = self.scheduler.block_manager
        try:
            manager.resize(num_blocks)
        except ValueError as e:
            raise ParkRefused(f"busy: {e}") from None
        try:
            nbytes = self.runner.resize_kv(num_blocks)
        except BaseException:
            manager.resize(self.runner.num_blocks)  # the cache is unchanged: so are the blocks handed out
            raise
        self.scheduler.config = replace(self.scheduler.config, num_blocks=num_blocks)
        return nbytes

    def capture_pending_graph(self) -> bool:
        """Idle time of a lazily started engine (`EngineConfig.lazy_graphs`): capture one decode graph it
        has not captured yet, then one prefill graph (`EngineConfig.prefill_graph_tokens`); False when none
        is left (then there is nothing for idle time)."""
        self._drain()
        return self.runner.capture_pending_graph()

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapter_slot: int = 0,
    ) -> str:
        """Queue a request (text, or token ids); it joins the running batch at the next step.
        `adapter_slot`: which adapter serves it, on an engine with adapter slots."""
        params = params or SamplingParams()
        num_slots = self.runner.num_adapter_slots
        if not isinstance(adapter_slot, int) or not 0 <= adapter_slot < num_slots:
            raise ValueError(
                f"adapter_slot: {adapter_slot!r} is not one of this engine's slots 0..{num_slots - 1}"
            )
        if self.runner.parked:
            raise RuntimeError("add_request: the engine is parked (unpark it first)")
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            prompt_text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt: empty (it has no tokens)")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        seq = Seq(seq_id=request_id, prompt_token_ids=token_ids, params=params, adapter_slot=adapter_slot)
        self.scheduler.add(seq)  # raises ValueError for a prompt longer than max_model_len
        self._requests[request_id] = _Request(
            seq=seq,
            output=RequestOutput(request_id, prompt_text, list(token_ids), arrival_time=time.perf_counter()),
            incremental=IncrementalOutput(self.tokenizer, token_ids, params, eos_token_id=self.eos_token_ids),
            generator=make_generator(params.seed, self.device),
        )
        return request_id

    def set_deadline(self, request_id: str, deadline_s: float | None) -> None:
        """The request's TTFT deadline in unix seconds (`time.time()`'s clock; None: none). With
        `EngineConfig.deadline_order` the scheduler serves pending prefills by it (docs/scheduler.md)."""
        self.scheduler.set_deadline(request_id, deadline_s)

    def abort(self, request_id: str) -> bool:
        """Drop a request; True when it was running."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        self._finish(req, "abort", req.incremental.finish("abort").text)
        return True

    @property
    def num_queued_steps(self) -> int:
        """Steps queued on the device and not read back yet: 0 or 1 (1 only with overlapped steps)."""
        return int(self._inflight is not None)

    def has_unfinished(self) -> bool:
        """Requests not finished, or deltas read back and not returned yet: call `step` again. A queued step
        whose rows all belong to ended requests (a stop token ended the last one) does not count: nothing
        comes of it, so an idle engine is idle (a worker parks it); whatever changes what it uses reads it
        back first (`_drain`), and so does the next `step`."""
        return bool(self._requests or self._ready)

    def kv_offload_stats(self) -> dict[str, int]:
        """Swaps out/in, their bytes, recomputes since start, host bytes held now (heartbeat fields)."""
        return {
            **self.offload.stats.as_fields(),
            "kv_host_bytes": self.offload.host_blocks_used * self.offload.block_bytes,
            # what batch waves may overflow into (the batch runner's packing reads it)
            "kv_host_budget_bytes": self.offload.num_host_blocks * self.offload.block_bytes,
        }

    @property
    def num_pending_prefills(self) -> int:
        """Requests with prompt tokens still to compute (the worker's GPU admission asks for these)."""
        return self.scheduler.num_pending_prefills

    def pending_prefill_tokens(self, request_ids: Collection[str] | None = None) -> int:
        """Tokens the pending prefills (of `request_ids` only, when given) still have to compute."""
        return self.scheduler.pending_prefill_tokens(request_ids)

    @property
    def num_pending_online_prefills(self) -> int:
        """Pending prefills of online requests: with none, the GPU admission asks without a deadline."""
        return self.scheduler.num_pending_online_prefills

    def next_prefill_deadline(self, now_s: float | None = None) -> float | None:
        """The TTFT deadline (unix seconds) of the first prompt the next step's deadline plan serves on time
        (`Scheduler.next_prefill_deadline` at `now_s`, default now): what the worker's GPU admission bids
        with. None: first come first served (`deadline_order` off), or no online prompt can make it."""
        if not self.scheduler.config.deadline_order:
            return None
        return self.scheduler.next_prefill_deadline(time.time() if now_s is None else now_s)

    def priority_of(self, request_id: str) -> int | None:
        """The request's class (0 online, 1 offline batch), None for an unknown request."""
        req = self._requests.get(request_id)
        return None if req is None else req.seq.params.priority

    def get_output(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        return None if req is None else req.output

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapter_slots: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (alongside whatever else is queued); outputs in prompt order.
        `adapter_slots`: each prompt's adapter slot (engines with adapter slots; default all 0)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        slots = list(adapter_slots) if adapter_slots is not None else [0] * len(prompts)
        if len(slots) != len(prompts):
            raise ValueError(f"adapter_slots: {len(slots)} given for {len(prompts)} prompts")
        ids = [
            self.add_request(p, sp, adapter_slot=s) for p, sp, s in zip(prompts, params, slots, strict=True)
        ]
        outputs = {i: self._requests[i].output for i in ids}
        while any(not o.finished for o in outputs.values()):
            self.step()
        return [outputs[i] for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Deltas of one request as they are generated (other queued requests advance too)."""
        request_id = self.add_request(prompt, params)
        output = self._requests[request_id].output
        try:
            while not output.finished:
                for delta in self.step():
                    if delta.request_id == request_id:
                        yield delta
        finally:
            if not output.finished:
                self.abort(request_id)

    # ------------------------------------------------------------------ one iteration

    def step(self, allow_prefill: bool = True, max_prefill_tokens: int | None = None) -> list[StreamDelta]:
        """Run one iteration of the batch; returns the deltas of the requests that advanced.

        `allow_prefill=False` runs the decodes only (the GPU's prefill slot is another worker's);
        `max_prefill_tokens` caps the step's prefill chunks at the tokens the GPU's admission granted.
        `last_step` tells what ran: (prefill sequences, decode sequences), for the latency profile.

        With overlapped steps (`overlap_steps`) the step is queued on the device first, then the previous
        step's tokens are read back and turned into text while it runs: the deltas returned are the previous
        step's. A request that ended there (a stop token or string) had a row in this step too; that row's
        token is dropped."""
        deltas, self._ready = self._ready, []
        # deadlines are unix seconds; the scheduler predicts with the prefill cost self.offload measures
        now = time.time() if self.scheduler.config.deadline_order else None
        out = self.scheduler.schedule(
            allow_prefill=allow_prefill, max_prefill_tokens=max_prefill_tokens, now=now
        )
        self.last_prefill_tokens = out.num_batched_tokens - out.num_decodes
        self.last_step = _sequences(out)
        self.num_preemptions += len(out.preempted)
        for seq in out.finished:  # the scheduler's max_model_len safety net
            req = self._requests.pop(seq.seq_id, None)
            if req is not None:
                deltas.append(self._finish(req, "length", req.incremental.finish("length").text))
        kv = self.runner.kv_cache
        for seq_id, blocks in out.swap_out:  # all swap-outs before any swap-in: blocks may be reused
            self._host_kv[seq_id] = kv.swap_out(blocks)
        for seq_id, blocks in out.swap_in:
            kv.swap_in(self._host_kv.pop(seq_id), blocks)
        launched = None if out.is_empty else self._launch(out)
        previous, self._inflight = self._inflight, launched
        if launched is not None and not self.overlap_steps:
            previous, self._inflight = launched, None
        self.last_read_step = None
        if previous is not None:
            deltas += self._read_back(previous)
            self.last_read_step = _sequences(previous.out)
        return deltas

    def _launch(self, out: SchedulerOutput) -> _Launched:
        """Queue the step's forward and sampling, start copying its tokens to the host, and advance the
        scheduler as if they were known (placeholders; `_read_back` writes the tokens). A request whose new
        token is certain to end it (its `max_tokens`, or `max_model_len`) leaves the scheduler now, so the
        next step does not compute it."""
        pending = None if self._inflight is None else self._inflight.pending(self._requests)
        measured = out.num_batched_tokens - out.num_decodes >= self.offload.config.min_measured_tokens
        timer = _StepTimer(self.device) if measured else None
        sampling, logits = self.runner.execute(out, pending)
        reqs = [self._requests[c.seq_id] for c in sampling]
        tokens = host = ready = None
        if sampling:
            tokens = sample(logits, [r.seq.params for r in reqs], [r.generator for r in reqs])
        if timer is not None:
            timer.stop()  # before `ready`: the wait for the tokens is a wait for the timer's end too
        if tokens is not None and self.device.type == "cuda":
            host = torch.empty(len(sampling), dtype=torch.int64, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        elif tokens is not None:
            host = tokens
        rows = {c.seq_id: row for row, c in enumerate(sampling)}
        where: dict[str, tuple[int, int]] = {}
        at_max_len: set[str] = set()
        for seq in self.scheduler.update(out, dict.fromkeys(rows, PENDING_TOKEN)):
            where[seq.seq_id] = (seq.num_tokens - 1, rows[seq.seq_id])
            full = self.scheduler.reached_max_model_len(seq)
            if full:
                at_max_len.add(seq.seq_id)
            if full or seq.num_output_tokens >= seq.params.max_tokens:
                self.scheduler.finish(seq.seq_id, "length")  # the token decides the reason the client sees
        return _Launched(out, reqs, where, tokens, host, ready, at_max_len, timer)

    def _read_back(self, step: _Launched) -> list[StreamDelta]:
        """Wait for a launched step's tokens, write them over their placeholders, and turn them into text and
        finish decisions; the deltas. Rows of requests that ended (or were aborted) since are dropped."""
        if step.host is None:
            return []
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.host.tolist()
        if step.timer is not None:  # a prefill-heavy step teaches the recompute cost per token (decodes in
            # it count as tokens too)
            self.offload.observe_prefill(step.out.num_batched_tokens, step.timer.seconds())
        now = time.perf_counter()
        deltas: list[StreamDelta] = []
        for req, token in zip(step.reqs, tokens, strict=True):
            seq = req.seq
            entry = step.where.get(seq.seq_id)
            if entry is None:  # aborted before its step ran: no token was appended
                continue
            seq.output_token_ids[entry[0] - seq.num_prompt_tokens] = token
            if self._requests.get(seq.seq_id) is not req:  # ended or aborted meanwhile
                continue
            delta = req.incremental.push(token)
            text, reason = delta.text, delta.finish_reason
            if reason is None and seq.seq_id in step.at_max_len:
                reason = "length"
                text += req.incremental.finish(reason).text
            out_ = req.output
            out_.token_ids.append(token)
            if out_.first_token_time is None:
                out_.first_token_time = now
            if reason is None:
                out_.text += text
                deltas.append(StreamDelta(seq.seq_id, [token], text))
            else:
                self.scheduler.finish(seq.seq_id, reason)  # a no-op when `_launch` finished it already
                del self._requests[seq.seq_id]
                deltas.append(self._finish(req, reason, text, [token]))
        return deltas

    def _drain(self) -> None:
        """Read back the step still queued (overlapped steps) before something changes what it uses (the KV
        cache, the graphs, an adapter); its deltas come with the next `step`."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._ready += self._read_back(step)

    def _finish(
        self, req: _Request, reason: str, text: str, token_ids: list[int] | None = None
    ) -> StreamDelta:
        out = req.output
        self._host_kv.pop(out.request_id, None)  # swapped out and ended (aborted): drop the copy
        out.text += text
        out.finish_reason = reason
        out.finish_time = time.perf_counter()
        return StreamDelta(
            out.request_id,
            token_ids or [],
            text,
            True,
            reason,
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids),
        )
