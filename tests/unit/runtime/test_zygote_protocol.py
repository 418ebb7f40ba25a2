"""The zygote's wire messages and which command lines it may run (no torch, no processes)."""

from __future__ import annotations

import sys

import pytest

from lorafn.local.procs import lorafn_argv
from lorafn.runtime.zygote import Exited, Forked, ForkRequest, Refused, cli_args, decode, encode


def test_messages_round_trip_one_line_each() -> None:
    messages = [
        ForkRequest(argv=lorafn_argv("worker", "serve"), env={"A": "1"}, cwd="/", log_path="/tmp/x.log"),
        Forked(pid=12),
        Refused(reason="CUDA is initialized"),
        Exited(pid=12, code=-9),
    ]
    for message in messages:
        line = encode(message)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert decode(line.rstrip(b"\n")) == message


@pytest.mark.parametrize(
    "line", [b"", b"{}", b'{"type": "fork"}', b'{"type": "exec", "argv": []}', b"not json"]
)
def test_anything_else_is_a_value_error(line: bytes) -> None:
    with pytest.raises(ValueError):
        decode(line)


def test_only_this_interpreter_running_the_lorafn_cli_can_be_forked() -> None:
    assert cli_args(lorafn_argv("worker", "serve", "--standby")) == ["worker", "serve", "--standby"]
    assert cli_args([sys.executable, "-m", "lorafn.cli", "gateway", "serve"]) == ["gateway", "serve"]
    assert cli_args(["/usr/bin/env", "-P", "-m", "lorafn.cli", "worker"]) is None  # another program
    assert cli_args([sys.executable, "-c", "print(1)"]) is None
    assert cli_args([sys.executable, "-P", "-m", "other.module"]) is None
    assert cli_args([]) is None
