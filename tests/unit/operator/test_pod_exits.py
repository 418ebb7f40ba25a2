"""Which pod states the operator reports to the controller as worker exits (pure reducer)."""

from __future__ import annotations

from lorafn.operator.reducers import pod_exits
from lorafn.store.control import PodExit


def _pod(name: str, status: dict) -> dict:
    return {"metadata": {"name": name}, "status": status}


def test_non_zero_terminations_now_and_before_the_last_restart_and_failed_pods() -> None:
    pods = [
        _pod(
            "w-0",
            {
                "phase": "Running",
                "containerStatuses": [{"name": "worker", "restartCount": 0, "state": {"running": {}}}],
            },
        ),
        _pod(
            "w-1",
            {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "worker",
                        "restartCount": 2,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {
                            "terminated": {
                                "exitCode": 1,
                                "reason": "Error",
                                "message": "no CUDA",
                                "finishedAt": "t9",
                            }
                        },
                    }
                ],
            },
        ),
        _pod(
            "w-2",
            {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": "worker",
                        "restartCount": 0,
                        "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": "t3"}},
                    }
                ],
            },
        ),
        _pod(
            "w-3",
            {
                "phase": "Succeeded",
                "containerStatuses": [{"name": "worker", "state": {"terminated": {"exitCode": 0}}}],
            },
        ),
        _pod("w-4", {"phase": "Failed", "reason": "Evicted"}),
        _pod("w-5", {"phase": "Pending"}),
    ]
    assert pod_exits(pods, "ns/f") == [
        PodExit("w-1", "ns/f", 1, "Error: no CUDA", "worker/1/t9"),
        PodExit("w-2", "ns/f", 137, "OOMKilled", "worker/0/t3"),
        PodExit("w-4", "ns/f", None, "Evicted", "pod"),
    ]
