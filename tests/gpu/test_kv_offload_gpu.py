"""KV offload on CUDA (pinned host memory, non-blocking copies ordered on the stream, CUDA graphs on): batch
requests preempted by online ones and swapped out and back yield exactly the tokens of the same requests
run alone (tiny model, float32, greedy), and the host copies are all given back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.config import ModelConfig
from lorafn.runtime.kv_offload import OffloadConfig
from lorafn.runtime.lora import write_random_adapter
from tests.integration.runtime.engine_helpers import mixed_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_swapped_batch_requests_on_cuda_answer_as_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter = write_random_adapter(ModelConfig.from_dir(tiny_model_dir), tmp_path / "a", rank=8, b_std=0.5)
    batch = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, priority=1)
    online = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batch_prompts = mixed_prompts(seed=2, lengths=(30, 28, 25, 33))
    online_prompts = mixed_prompts(seed=3, lengths=(20, 24))

    def engine(offload: OffloadConfig, **kw: int) -> Engine:
        return Engine(
            EngineConfig(
                model=tiny_model_dir, adapter=adapter, device="cuda", dtype="float32", kv_offload=offload,
                max_num_batched_tokens=64, cache_dir=tmp_path, **kw,
            )
        )  # fmt: skip

    alone = engine(OffloadConfig(host_budget_bytes=0), num_kv_blocks=256)
    params = [batch] * len(batch_prompts) + [online] * len(online_prompts)
    expected = [o.token_ids for o in alone.generate(batch_prompts + online_prompts, params)]
    del alone

    # 40 blocks of 16 = 640 positions would hold all; 12 blocks = 192 make the online requests preempt
    e = engine(OffloadConfig(host_link_bytes_per_s=1e30, prefill_s_per_token=1.0), num_kv_blocks=12)
    ids = [e.add_request(p, batch) for p in batch_prompts]
    for _ in range(6):
        e.step()
    ids += [e.add_request(p, online) for p in online_prompts]
    outputs = {i: e.get_output(i) for i in ids}
    while e.has_unfinished():
        e.step()
    assert [outputs[i].token_ids for i in ids] == expected  # type: ignore[union-attr]
    stats = e.kv_offload_stats()
    assert stats["kv_swaps_out"] > 0, stats
    assert stats["kv_swaps_in"] == stats["kv_swaps_out"] and stats["kv_host_bytes"] == 0
