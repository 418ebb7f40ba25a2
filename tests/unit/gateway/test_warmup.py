"""The gateway runs its response paths once at start-up (lorafn.gateway.warmup): the first streamed request
of the process imported anyio's asyncio backend inside its latency (14 ms on the dev VM, ~80 ms on the H100
host, where packages have no byte-code)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_warm_up_streams_and_leaves_the_task_group_backend_loaded() -> None:
    # a fresh interpreter: in this one pytest's own plugins may have loaded anyio's backend already
    code = textwrap.dedent(
        """
        import asyncio, sys
        from lorafn.gateway.warmup import warm_response_paths
        assert "anyio._backends._asyncio" not in sys.modules, "loaded before: proves nothing"
        sent = asyncio.run(warm_response_paths())
        print(sent, "anyio._backends._asyncio" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    sent, loaded = out.stdout.split()
    assert int(sent) > 200  # two SSE answers (role, text, finish, usage, [DONE]) and one JSON body
    assert loaded == "True"
