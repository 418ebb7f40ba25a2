"""One request as the scheduler sees it (pure Python: no torch).

A sequence's tokens are ``prompt_token_ids + output_token_ids``; ``num_computed_tokens`` of them
have their KV in the cache (positions ``0 .. num_computed_tokens - 1``), in the blocks listed in
``block_table``. The slot of position ``p`` is
``block_table[p // block_size] * block_size + p % block_size``.

Preemption is by recompute or by swap. Recompute: the blocks are freed and ``num_computed_tokens``
drops to 0; the tokens already generated are kept (and never emitted again) and the whole ``prompt +
output`` is prefilled again when the sequence is re-admitted; the last chunk of that prefill samples the
next new token. Swap: the computed KV is copied to host memory first (``swapped_tokens``) and back into
new blocks at re-admission, where the sequence goes on from ``num_computed_tokens = swapped_tokens``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from lorafn.runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding KV blocks: new, or preempted
    RUNNING = "running"  # admitted: holds the blocks for its computed (and soon computed) tokens
    FINISHED = "finished"  # done (finish_reason says why); holds no blocks


@dataclass(eq=False)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    arrival: int = -1  # set by Scheduler.add: a strictly increasing admission priority (lower = older)
    num_preemptions: int = 0
    adapter_slot: int = (
        0  # the adapter serving it, on an engine with adapter slots (EngineConfig.adapter_slots)
    )
    # Preempted by swap (kv_offload.py): positions 0 .. swapped_tokens - 1 have their KV in host memory
    # (the engine holds the copy); 0 = none. Set only while WAITING; admission copies it back into blocks.
    swapped_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (1 for a sequence in decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``start .. end - 1`` without building the whole list when avoidable."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
