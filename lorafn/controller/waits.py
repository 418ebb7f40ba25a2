"""How long functions with demand waited for a worker, and why: one `Wait` cause at a time per function.

The policy gives a function that gets no worker in a round a `Wait` with a cause (`WaitCause`: a start
slot, memory being freed, a standby warming up, ...). The driver hands each round's waits to `WaitTracker`,
which turns them into episodes: a function starts waiting, its cause changes, it stops waiting (a worker
came, or its demand went). Each step says how long the cause it ends lasted, for the log line and the
`lorafn_controller_wait_seconds_total{cause}` counter: where a cold start's time before its decision went
(a late fresh start's "controller" phase in bench/replay_breakdown.py). Steps are seen at rounds: a wait that
a bind between rounds ended (the driver's fast path) ends at the next round, up to an interval late. Pure:
the caller passes the clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WaitStep:
    """``function`` began waiting for ``cause`` (``ended`` None), or its ``ended`` cause lasted
    ``seconds`` and it now waits for ``cause`` (None: it no longer waits, after ``total_s`` in all)."""

    function: str
    cause: str | None
    reason: str
    ended: str | None = None
    seconds: float = 0.0
    total_s: float = 0.0


class WaitTracker:
    """Per function: the cause it waits for now, since when, and since when it has waited at all."""

    def __init__(self) -> None:
        self._now: dict[str, tuple[str, float, float]] = {}  # function -> (cause, cause since, waiting since)

    def update(self, waits: Mapping[str, tuple[str, str]], now: float) -> list[WaitStep]:
        """``waits``: this round's function -> (cause, reason). Returns the steps, in function order."""
        steps: list[WaitStep] = []
        for function in sorted(set(self._now) | set(waits)):
            held = self._now.get(function)
            new = waits.get(function)
            if held is None and new is not None:
                self._now[function] = (new[0], now, now)
                steps.append(WaitStep(function, new[0], new[1]))
            elif held is not None and new is None:
                del self._now[function]
                steps.append(WaitStep(function, None, "", held[0], now - held[1], now - held[2]))
            elif held is not None and new is not None and new[0] != held[0]:
                self._now[function] = (new[0], now, held[2])
                steps.append(WaitStep(function, new[0], new[1], held[0], now - held[1], now - held[2]))
        return steps

    @property
    def waiting(self) -> dict[str, str]:
        """function -> the cause it waits for now."""
        return {f: cause for f, (cause, _, _) in self._now.items()}
