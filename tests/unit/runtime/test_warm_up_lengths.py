"""`standby.warm_up_lengths`: the prompt lengths a standby prefills before it waits (pure)."""

from __future__ import annotations

from lorafn.runtime.standby import WARM_PROMPT_LENGTHS, warm_up_lengths


def test_a_gpu_standby_warms_aligned_and_unaligned_lengths_up_to_a_chunked_prompt() -> None:
    got = warm_up_lengths(capacity=65536, max_len=4096, step_tokens=2048, gpu=True)
    assert got == sorted({*WARM_PROMPT_LENGTHS, 2048, 2065})
    assert any(n % 16 for n in got) and any(n % 128 == 0 for n in got)  # both kinds of tile fit
    assert max(got) > 2048  # one prompt longer than a step: its second chunk attends to a cached prefix


def test_lengths_fit_the_kv_budget_and_the_model() -> None:
    assert warm_up_lengths(capacity=600, max_len=4096, step_tokens=2048, gpu=True) == [16, 40, 100, 250, 512]
    assert max(warm_up_lengths(capacity=65536, max_len=1024, step_tokens=2048, gpu=True)) <= 1016
    assert warm_up_lengths(capacity=20, max_len=4096, step_tokens=2048, gpu=True) == [12]  # what fits
    assert warm_up_lengths(capacity=8, max_len=4096, step_tokens=2048, gpu=True) == []


def test_a_cpu_standby_warms_one_short_prompt() -> None:
    # (it was 16 and 512 tokens: the 512 made no later request faster on CPU and cost 1.8 s of every core)
    assert warm_up_lengths(capacity=65536, max_len=4096, step_tokens=2048, gpu=False) == [16]
    assert warm_up_lengths(capacity=128, max_len=4096, step_tokens=2048, gpu=False) == [16]
    assert warm_up_lengths(capacity=20, max_len=4096, step_tokens=2048, gpu=False) == [12]  # what fits
    assert warm_up_lengths(capacity=8, max_len=4096, step_tokens=2048, gpu=False) == []
