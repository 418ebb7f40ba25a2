"""Child processes of `lorafn up`, as real processes: the lorafn they run, and restart backoff."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafn.local.procs import ProcessGroup, RestartPolicy, child_env, lorafn_argv

FAILS = [sys.executable, "-c", "import sys; print('OSError: [Errno 98] address already in use'); sys.exit(1)"]


def test_children_run_this_lorafn_from_a_folder_holding_a_lorafn_dir(tmp_path: Path) -> None:
    (tmp_path / "lorafn").mkdir()  # what the clone looks like from its parent folder
    done = subprocess.run(
        lorafn_argv("--version"), cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("lorafn ")


def test_a_component_failing_the_same_way_backs_off_then_gives_up(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path, RestartPolicy(base_s=0.2, cap_s=0.5, give_up_after=4))
    delays, waited = [], []
    for _ in range(4):
        started = time.monotonic()
        child = group.start("gateway", FAILS)
        waited.append(time.monotonic() - started)
        child.proc.wait(timeout=30)
        assert [c.name for c in group.reap()] == ["gateway"]
        delays.append(group.restarts.delay_s("gateway"))
    assert delays == [0.2, 0.4, 0.5, 0.5]  # doubling, capped
    assert waited[0] < 0.2 and waited[1] >= 0.2 and waited[2] >= 0.4
    with pytest.raises(RuntimeError, match=r"gateway failed 4 times in a row .* address already in use"):
        group.start("gateway", FAILS)


def test_a_different_failure_or_a_long_run_starts_the_count_again() -> None:
    policy = RestartPolicy(base_s=1.0, quick_s=5.0, give_up_after=2)
    policy.exited("backbone/x", ran_s=0.5, last_line="error A")
    assert policy.delay_s("backbone/x") == 1.0 and policy.give_up("backbone/x") is None
    policy.exited("backbone/x", ran_s=0.5, last_line="error B")
    assert policy.delay_s("backbone/x") == 1.0 and policy.give_up("backbone/x") is None
    policy.exited("backbone/x", ran_s=0.5, last_line="error B")
    assert policy.give_up("backbone/x") is not None
    policy.exited("backbone/x", ran_s=60.0, last_line="error B")  # it ran a while: not a start-up error
    assert policy.delay_s("backbone/x") == 0.0 and policy.give_up("backbone/x") is None
