"""Snapshot types refuse bad input with a ValueError naming the field."""

from __future__ import annotations

import pytest

from lorafn.controller.policy import GPU, Backbone, Costs, Function, Worker

from .helpers import COSTS, GiB, fn, gpu, snap, standby


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: GPU("g", "n", -1), "total_bytes"),
        (lambda: GPU("g", "n", GiB, {"llama": -5}), "backbones['llama']"),
        (lambda: Worker("w", "g", "llama", "sleeping", None, None, 0), "state"),
        (lambda: Worker("w", "g", "llama", "bound", "r16", None, 0), "function"),
        (lambda: Worker("w", "g", "llama", "standby", None, "ns/f", 0), "function"),
        (lambda: Worker("w", "g", "llama", "standby", None, None, 0, running=-1), "running"),
        (lambda: Function("ns/f", "llama", "r16", GiB, min_replicas=3, max_replicas=2), "max_replicas"),
        (lambda: Function("ns/f", "llama", "r16", GiB, arrival_rate=float("nan")), "arrival_rate"),
        (lambda: Function("ns/f", "llama", "r16", GiB, queued=True), "queued"),
        (lambda: Backbone("llama", GiB, min_standby_per_gpu=5, max_standby_per_gpu=1), "min_standby_per_gpu"),
        (lambda: Costs(fresh_start_s=-1, bind_s=0), "fresh_start_s"),
        (lambda: Costs(fresh_start_s=1, bind_s=0, standby_bytes={"r8": 1.5}), "standby_bytes['r8']"),
    ],
)
def test_bad_fields_are_named(build, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        build()


def test_snapshot_refuses_duplicates_and_unknown_gpus():
    with pytest.raises(ValueError, match="duplicate id 'g0'"):
        snap([gpu("g0"), gpu("g0")])
    with pytest.raises(ValueError, match="duplicate name 'ns/f'"):
        snap([gpu("g0")], [fn("ns/f"), fn("ns/f")])
    with pytest.raises(ValueError, match=r"Worker s1\.gpu 'g9'"):
        snap([gpu("g0")], workers=[standby("s1", "g9")])


def test_costs_standby_bytes_and_saving():
    costs = Costs(fresh_start_s=20, bind_s=1, capture_s=4, default_standby_bytes=3, standby_bytes={"r8": 1})
    assert costs.standby_bytes_for("r8") == 1
    assert costs.standby_bytes_for("r64") == 3
    assert costs.bind_saving_s(prepared=True) == 19
    assert costs.bind_saving_s(prepared=False) == 15
    assert Costs(fresh_start_s=2, bind_s=1, capture_s=4).bind_saving_s(prepared=False) == 0
    assert COSTS.standby_bytes_for(None) == 2 * GiB
