"""`lorafn up` on a CPU host: what its cores warm at once, and OpenMP's passive wait for every process that
computes on them (the README demo's first cold start took 16.7 s on the 2-core VM; docs/benchmarks.md)."""

from __future__ import annotations

import os

import pytest

from lorafn.controller.policy import PolicyConfig
from lorafn.local.config import LocalConfig, cpu_worker_threads, host_cores
from lorafn.local.executor import cpu_compute_env


def test_on_cpu_the_pool_warms_what_the_cores_can_at_once_and_waits_for_demand() -> None:
    auto = LocalConfig()
    assert auto.pool_start_policy("cpu", cores=2, worker_threads=2) == {
        "max_pool_starts_per_node": 1,
        "pool_waits_for_demand": True,
    }
    assert auto.pool_start_policy("cpu", cores=16, worker_threads=4)["max_pool_starts_per_node"] == 4
    assert auto.pool_start_policy("cpu", cores=3, worker_threads=8)["max_pool_starts_per_node"] == 1
    # a GPU's host is not the device: no limit, no hold (the behaviour before)
    assert auto.pool_start_policy("cuda", cores=16, worker_threads=1) == {
        "max_pool_starts_per_node": None,
        "pool_waits_for_demand": False,
    }
    # set explicitly: 0 = no limit, and the hold either way
    explicit = LocalConfig(pool_starts_at_once=0, pool_waits_for_demand=False)
    assert explicit.pool_start_policy("cpu", 2, 2) == {
        "max_pool_starts_per_node": None,
        "pool_waits_for_demand": False,
    }
    assert LocalConfig(pool_starts_at_once=3).pool_start_policy("cuda", 2, 2)["max_pool_starts_per_node"] == 3
    # what it returns is what PolicyConfig takes
    PolicyConfig(**auto.pool_start_policy("cpu", 2, 2))
    with pytest.raises(ValueError, match="cores"):
        auto.pool_start_policy("cpu", cores=0, worker_threads=1)
    with pytest.raises(ValueError, match="pool_starts_at_once"):
        LocalConfig(pool_starts_at_once=-1)


def test_a_cpu_worker_computes_on_omp_num_threads_else_one_thread_per_core() -> None:
    assert cpu_worker_threads({}, 8) == 8
    assert cpu_worker_threads({"OMP_NUM_THREADS": "2"}, 8) == 2
    assert cpu_worker_threads({"OMP_NUM_THREADS": "0"}, 8) == 8
    assert cpu_worker_threads({"OMP_NUM_THREADS": "two"}, 8) == 8
    assert 1 <= host_cores() <= (os.cpu_count() or 1)


def test_cpu_processes_wait_passively_unless_the_user_chose_a_policy() -> None:
    assert cpu_compute_env({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_compute_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
