"""What the account charges a live worker (controller.policy.charge): its own driver-counted size once its
decode graphs are captured, never below its peers' settled overhead quantile; the learned (largest + margin)
overhead before that, and for anything without a driver report."""

from __future__ import annotations

import pytest

from lorafn.controller.policy.charge import (
    MIN_FLOOR_REPORTS,
    OVERHEAD_MARGIN_BYTES,
    SizeReport,
    charge_bytes,
    learned_overhead,
    overhead_floor,
)

MiB = 2**20
KV, LORA = 512 * MiB, 80 * MiB
LEARNED = 1086 * MiB + OVERHEAD_MARGIN_BYTES  # the largest overhead reported + the margin
ESTIMATE = KV + LORA + LEARNED  # what a worker of the function is started with


def test_floor_is_the_nearest_rank_quantile_of_settled_overheads():
    overheads = [int(o * MiB) for o in range(700, 1000, 10)]  # 30 reports: 700 .. 990 MiB
    assert overhead_floor(overheads, LEARNED, quantile=0.9) == 960 * MiB  # the 27th of 30
    assert overhead_floor(overheads, LEARNED, quantile=0.5) == 840 * MiB  # the 15th
    assert overhead_floor(overheads, LEARNED, quantile=1.0) == 990 * MiB
    # 10 reports, q 0.9: exactly the 9th (no float rounding up to the 10th)
    assert overhead_floor([i * MiB for i in range(1, 11)], LEARNED, quantile=0.9) == 9 * MiB


def test_floor_with_few_or_no_reports_and_never_above_the_learned_overhead():
    few = [800 * MiB, 900 * MiB][: MIN_FLOOR_REPORTS - 1]
    assert overhead_floor(few, LEARNED) == 900 * MiB  # too few for a quantile: the largest
    assert overhead_floor([], LEARNED) == LEARNED  # nobody settled: the learned figure
    assert overhead_floor([0, -3], LEARNED) == LEARNED  # nonsense is not learned from
    assert overhead_floor([2000 * MiB] * 10, LEARNED) == LEARNED
    with pytest.raises(ValueError, match="quantile"):
        overhead_floor([MiB], LEARNED, quantile=0.0)


def test_a_settled_worker_is_charged_its_own_report_plus_the_margin():
    floor = 908 * MiB
    big = SizeReport(KV + LORA + 1000 * MiB, KV, LORA, settled=True)
    assert charge_bytes(big, ESTIMATE, floor) == big.whole_bytes + OVERHEAD_MARGIN_BYTES
    assert charge_bytes(big, ESTIMATE, floor) < ESTIMATE  # room the learned charge left unused
    # one below its peers' floor (short prompts so far: its activations may still grow) pays the floor
    small = SizeReport(KV + LORA + 760 * MiB, KV, LORA, settled=True)
    assert charge_bytes(small, ESTIMATE, floor) == KV + LORA + floor
    # private weights (no sharing) are part of the floor's base as of the report
    private = SizeReport(KV + LORA + 13 * 1024 * MiB + 700 * MiB, KV, LORA, 13 * 1024 * MiB, settled=True)
    assert charge_bytes(private, ESTIMATE + 13 * 1024 * MiB, floor) == KV + LORA + 13 * 1024 * MiB + floor


def test_the_own_charge_never_exceeds_the_learned_estimate_unless_the_report_does():
    # its own + margin above the estimate, its report below: the estimate covers it (as before)
    near = SizeReport(ESTIMATE - 10 * MiB, KV, LORA, settled=True)
    assert charge_bytes(near, ESTIMATE, 908 * MiB) == ESTIMATE
    # it reports more than the estimate: its report + margin (it has grown past every other)
    past = SizeReport(ESTIMATE + 100 * MiB, KV, LORA, settled=True)
    assert charge_bytes(past, ESTIMATE, 908 * MiB) == past.whole_bytes + OVERHEAD_MARGIN_BYTES


def test_graphs_pending_or_no_driver_report_keeps_the_learned_charge():
    pending = SizeReport(KV + LORA + 650 * MiB, KV, LORA, settled=False)
    assert charge_bytes(pending, ESTIMATE, 700 * MiB) == ESTIMATE  # its graphs' pool is still to come
    huge_pending = SizeReport(ESTIMATE + MiB, KV, LORA, settled=False)
    assert charge_bytes(huge_pending, ESTIMATE, 700 * MiB) == ESTIMATE + MiB
    assert charge_bytes(None, ESTIMATE, 700 * MiB) == ESTIMATE  # no heartbeat figure (CPU, no NVML)
    assert charge_bytes(SizeReport(0, KV, LORA, settled=True), ESTIMATE, 700 * MiB) == ESTIMATE


def test_learned_overhead_is_the_largest_report_plus_a_margin():
    assert learned_overhead([], 560 * MiB) == 560 * MiB
    assert learned_overhead([300 * MiB, 420 * MiB], 560 * MiB) == 420 * MiB + OVERHEAD_MARGIN_BYTES


def test_a_parked_worker_is_charged_what_it_holds_and_a_park_gives_back_the_difference():
    from lorafn.controller.policy.charge import park_sizes, parked_charge_bytes

    floor, release = 908 * MiB, KV + 150 * MiB  # KV + the graph pool
    # with the driver's count: parked, its report + the margin (no floor: it holds no KV, no graphs)
    parked = SizeReport(LORA + 900 * MiB, 0, LORA, settled=True)
    assert parked_charge_bytes(parked, ESTIMATE, release, LORA) == parked.whole_bytes + OVERHEAD_MARGIN_BYTES
    charge, back = park_sizes(parked, ESTIMATE, floor, release, parked=True)
    assert charge == parked.whole_bytes + OVERHEAD_MARGIN_BYTES
    # unparked it is charged as a worker whose graphs are pending again: its report + the release, at
    # least the estimate; unparking takes the difference back
    assert back == max(parked.whole_bytes + release, ESTIMATE) - charge
    # settled and unparked: its own charge; a park gives back that less its parked charge
    whole = SizeReport(KV + LORA + 1050 * MiB, KV, LORA, settled=True)
    charge, gives = park_sizes(whole, ESTIMATE, floor, release, parked=False)
    assert charge == charge_bytes(whole, ESTIMATE, floor)
    assert gives == charge - (whole.whole_bytes - release + OVERHEAD_MARGIN_BYTES)
    # without a driver count (CPU): the estimate less the release, never below the LoRA tensors
    assert park_sizes(None, ESTIMATE, floor, release, parked=True) == (ESTIMATE - release, release)
    assert park_sizes(None, ESTIMATE, floor, release, parked=False) == (ESTIMATE, release)
    assert parked_charge_bytes(None, ESTIMATE, 10 * ESTIMATE, LORA) == LORA
    # a worker that does not say what a park releases: charged as before, release unknown (0)
    assert park_sizes(whole, ESTIMATE, floor, 0, parked=False) == (charge_bytes(whole, ESTIMATE, floor), 0)
    assert park_sizes(None, ESTIMATE, floor, 0, parked=True) == (ESTIMATE, 0)
