"""`Scheduler.reset_blocks` (an unparked engine's new KV cache): every block free again, refused while a
sequence holds blocks."""

from __future__ import annotations

import pytest

from lorafn.runtime.sampling_params import SamplingParams
from lorafn.runtime.scheduler import Scheduler, SchedulerConfig
from lorafn.runtime.sequence import Sequence


def test_reset_blocks_only_when_no_sequence_is_unfinished() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, block_size=4, num_blocks=8))
    sched.add(Sequence(seq_id="a", prompt_token_ids=[1, 2, 3, 4, 5], params=SamplingParams(max_tokens=2)))
    sched.schedule()
    assert sched.block_manager.num_used_blocks == 2
    with pytest.raises(RuntimeError, match="1 unfinished sequences"):
        sched.reset_blocks()
    assert sched.block_manager.num_used_blocks == 2  # refused: nothing changed
    sched.finish("a", "stop")
    old = sched.block_manager
    sched.reset_blocks()
    assert sched.block_manager is not old
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks == 8
