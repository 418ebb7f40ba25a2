"""A fake engine that drives the Scheduler the way the real one does, with a fake paged KV cache.

The "model" is deterministic: the next token is a hash of all previous tokens. The fake engine
reads that context back from its fake KV cache through the block tables (each slot remembers
which sequence and position wrote it), so a wrong slot mapping, a block shared by two sequences, a
block freed while in use or a wrong recompute after preemption all change the tokens or trip an
assertion; the tokens are compared with a reference generated without any scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafn.runtime.block_manager import slot_mapping
from lorafn.runtime.kv_offload import OffloadPolicy
from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import DeadlinePlan, Scheduler, SchedulerConfig, SchedulerOutput
from lorafn.runtime.sequence import Sequence, SequenceStatus

VOCAB = 17


def next_token(tokens: list[int]) -> int:
    h = 0
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + t * 31 + i) % 2_147_483_647
    return h % VOCAB


def reference(prompt: list[int], params: SamplingParams, max_model_len: int) -> tuple[list[int], str]:
    """Tokens and finish reason of a request generated alone, without a scheduler."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        if token in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


@dataclass
class Request:
    seq_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int = 0
    abort_step: int | None = None  # the client goes away at this step (if still unfinished)
    deadline: float | None = None  # TTFT deadline on the step clock (`FakeEngine.step_s` per step)


@dataclass
class RunResult:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    num_preemptions: int = 0
    outputs_log: list[SchedulerOutput] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    plans: list[DeadlinePlan | None] = field(default_factory=list)  # the step's `last_plan`
    first_token_step: dict[str, int] = field(default_factory=dict)
    first_chunk_step: dict[str, int] = field(default_factory=dict)


class FakeEngine:
    def __init__(
        self,
        config: SchedulerConfig,
        offload: OffloadPolicy | None = None,
        prefill_cap: int | None = None,
        step_s: float = 1.0,
    ) -> None:
        self.config = config
        self.prefill_cap = prefill_cap  # every step's max_prefill_tokens (a GPU admission grant)
        self.step_s = step_s  # with deadline_order: `now` = steps run so far x step_s
        self.scheduler = Scheduler(config, offload)
        self.cache: list[tuple[str, int, int] | None] = [None] * (config.num_blocks * config.block_size)
        # swapped-out KV: seq_id -> the slots' entries of its swapped blocks, in position order
        self.host: dict[str, list[tuple[str, int, int] | None]] = {}
        self.num_swaps_in = 0

    def run_swaps(self, out: SchedulerOutput) -> None:
        """Swap-outs first (their blocks may be a swap-in's targets in the same step), then swap-ins."""
        bs = self.config.block_size
        for seq_id, blocks in out.swap_out:
            assert seq_id not in self.host, f"{seq_id} swapped out twice"
            self.host[seq_id] = [self.cache[b * bs + i] for b in blocks for i in range(bs)]
        for seq_id, blocks in out.swap_in:
            saved = self.host.pop(seq_id)
            assert len(saved) == len(blocks) * bs
            for j, entry in enumerate(saved):
                self.cache[blocks[j // bs] * bs + j % bs] = entry
            self.num_swaps_in += 1

    def check_step(self, out: SchedulerOutput, decode_ready: list[Sequence]) -> None:
        cfg, sched = self.config, self.scheduler
        chunks = out.chunks
        # Budget and batch size.
        assert out.num_batched_tokens == sum(c.num_tokens for c in chunks)
        if out.num_batched_tokens > cfg.max_num_batched_tokens:
            # Only an over-long prefill with chunking off, alone in its step.
            assert not cfg.enable_chunked_prefill
            assert len(chunks) == 1 and chunks[0].start == 0 and chunks[0].samples
        if self.prefill_cap is not None:
            prefill = [c.num_tokens for c in chunks if not c.is_decode]
            # chunked: never beyond the grant; unchunked: the step's first prefill may go whole beyond it
            assert sum(prefill) <= self.prefill_cap or (not cfg.enable_chunked_prefill and len(prefill) == 1)
        assert len(chunks) <= cfg.max_num_seqs
        assert sched.num_running <= cfg.max_num_seqs
        assert len({c.seq_id for c in chunks}) == len(chunks), "a sequence twice in one step"
        # Order: decodes, then partial prefills (start > 0), then new/readmitted (start == 0); a
        # sequence swapped back in goes on as a decode or a partial prefill.
        kinds = [0 if c.is_decode else (1 if c.start > 0 else 2) for c in chunks]
        assert kinds == sorted(kinds), f"chunk order {kinds}"
        assert out.num_decodes == kinds.count(0)
        for c in chunks:
            assert c.num_tokens >= 1
            assert c.seq.status is SequenceStatus.RUNNING
            assert c.start == c.seq.num_computed_tokens
            assert c.end <= c.seq.num_tokens
            assert c.samples == (c.end == c.seq.num_tokens)
            assert len(c.seq.block_table) * cfg.block_size >= c.end, "chunk not covered by blocks"
            assert c.end <= sched.max_model_len
            if not cfg.enable_chunked_prefill and not c.is_decode:
                assert c.start == 0 and c.samples, "unchunked prefill split"
        # Stall-free: every sequence ready to decode at the start of the step is scheduled, unless
        # preempted or it needed a new block that the cache did not have.
        scheduled = {c.seq_id for c in chunks}
        for seq in decode_ready:
            if seq.seq_id in scheduled or seq.seq_id in out.preempted or seq.is_finished:
                continue
            assert len(seq.block_table) * cfg.block_size < seq.num_tokens, (
                f"decode of {seq.seq_id} delayed without a memory reason"
            )
            assert sched.block_manager.num_free_blocks == 0
        # Blocks: exclusive, no leak; waiting sequences hold none.
        sched.block_manager.check_invariants(sched.running)
        for seq in sched.waiting:
            assert not seq.block_table and seq.num_computed_tokens == 0
        swapped = {s.seq_id for s in sched.waiting if s.swapped_tokens}
        assert not swapped & {sid for sid, _ in out.swap_in}
        if sched.offload is None:
            assert not out.swap_out and not out.swap_in and not swapped
        else:
            held = sum(-(-s.swapped_tokens // cfg.block_size) for s in sched.waiting)
            assert sched.offload.host_blocks_used == held, "host block account"
            assert held <= sched.offload.num_host_blocks

    def run_chunks(self, out: SchedulerOutput) -> dict[str, int]:
        bs = self.config.block_size
        sampled: dict[str, int] = {}
        for c in out.chunks:
            seq = c.seq
            slots = slot_mapping(seq.block_table, c.start, c.num_tokens, bs)
            for pos, (slot, token) in enumerate(zip(slots, c.token_ids, strict=True), start=c.start):
                self.cache[slot] = (seq.seq_id, pos, token)
            if c.samples:
                context = []
                for pos, slot in enumerate(slot_mapping(seq.block_table, 0, c.end, bs)):
                    entry = self.cache[slot]
                    assert entry is not None and entry[:2] == (seq.seq_id, pos), (
                        f"KV of {seq.seq_id} position {pos} overwritten: {entry}"
                    )
                    context.append(entry[2])
                sampled[seq.seq_id] = next_token(context)
        return sampled

    def run(self, requests: list[Request], max_steps: int) -> RunResult:
        sched = self.scheduler
        result = RunResult()
        pending = sorted(requests, key=lambda r: r.arrival_step)
        seqs: dict[str, Sequence] = {}
        step = 0
        while pending or sched.has_unfinished():
            while pending and pending[0].arrival_step <= step:
                r = pending.pop(0)
                seq = Sequence(r.seq_id, list(r.prompt), r.params)
                try:
                    sched.add(seq)
                except ValueError:
                    result.refused.append(r.seq_id)
                    continue
                seqs[r.seq_id] = seq
                sched.set_deadline(r.seq_id, r.deadline)
            for r in requests:
                if r.abort_step == step and r.seq_id in seqs and not seqs[r.seq_id].is_finished:
                    sched.abort(r.seq_id)
            step += 1
            assert step <= max_steps, f"no completion within {max_steps} steps"
            decode_ready = [s for s in sched.running if s.num_uncomputed_tokens == 1]
            now = (step - 1) * self.step_s if self.config.deadline_order else None
            out = sched.schedule(max_prefill_tokens=self.prefill_cap, now=now)
            result.outputs_log.append(out)
            result.plans.append(sched.last_plan)
            for c in out.chunks:
                result.first_chunk_step.setdefault(c.seq_id, step)
                if c.samples:
                    result.first_token_step.setdefault(c.seq_id, step)
            if sched.has_unfinished():  # progress: a step with work always schedules something
                assert out.chunks, "empty step while requests wait"
            self.check_step(out, decode_ready)
            self.run_swaps(out)
            sampled = self.run_chunks(out)
            for seq in sched.update(out, sampled):
                token = seq.output_token_ids[-1]
                if token in seq.params.stop_token_ids:
                    sched.finish(seq.seq_id, "stop")
                elif seq.num_output_tokens >= seq.params.max_tokens or sched.reached_max_model_len(seq):
                    sched.finish(seq.seq_id, "length")
            sched.block_manager.check_invariants(sched.running)
        assert sched.block_manager.num_free_blocks == self.config.num_blocks, "blocks leaked"
        if sched.offload is not None:
            assert sched.offload.host_blocks_used == 0, "host blocks leaked"
        for seq_id, seq in seqs.items():
            assert seq.is_finished and not seq.block_table
            result.outputs[seq_id] = list(seq.output_token_ids)
            result.reasons[seq_id] = seq.finish_reason  # type: ignore[assignment]
            result.num_preemptions += seq.num_preemptions
        result.steps = step
        return result
