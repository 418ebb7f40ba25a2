"""What the memory account charges a live worker (pure; `controller.snapshot` and the simulator call it).

A GPU worker's heartbeat carries the driver's count of its whole process (NVML by pid,
`runtime.gpu_memory`) with its KV-cache and LoRA parts; the rest is its *overhead*: CUDA context, loaded
kernel modules, cuBLAS workspaces, the decode-graph pool and the allocator's cached activations.

What still grows after a worker's first report (the runtime, read for issue 16):
- decode graphs: a fresh worker starts with `lazy_graphs` and captures each bucket's graph on first need
  or while idle (~1.2-1.6 s of idle time for a 7B on the H100); the graph pool and the side stream's
  cuBLAS workspace come then (~140-160 MiB, docs/benchmarks.md "Per-worker memory"). The worker says so
  (`graphs_pending` in its heartbeat); a standby captures them before it reports.
- activations: torch's caching allocator keeps the largest step's working set (~90 KiB a token of a 7B at
  the MLP: h, x, gate, up, act); a step holds at most `max_num_batched_tokens` (2048) tokens and at most
  what the worker's KV budget holds (~1000 tokens at 512 MiB of a 7B), so a worker whose steps were short
  can still grow by the difference: up to ~90 MiB at KV 512 MiB, ~180 MiB at 1 GiB and more (a warmed
  standby, which prefilled its longest, is ~90 MiB above the replay's median fresh worker at KV 512 MiB:
  1500 vs 1409 MiB per process). `bench/worker_growth.py` measures it on a GPU.
- kernel modules of step kinds it has not run yet (lazy module loading): a few MiB each.

The rule (`charge_bytes`): a worker that has not reported by the driver, or whose graphs are pending, is
charged as before (``learned_overhead``: the largest overhead any live worker reports + a margin: what a
fully grown worker needs). One whose graphs are captured is charged its own report + ``margin_bytes`` (the
next step's activations and modules), but never below KV + LoRA + ``floor_overhead``: the ``quantile``
of its peers' settled overheads (`overhead_floor`), so that a worker that has only seen short prompts is
charged what most of them grew to. What even that does not cover (a worker below the floor's peers that
then prefills a full step) is the account's headroom (``PolicyConfig.gpu_utilization``) and the driver's
own free memory (`account.accounts`' guard) to absorb.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MiB = 2**20
OVERHEAD_MARGIN_BYTES = 64 * MiB  # growth a settled worker may still have ahead (a longer step's activations)
FLOOR_QUANTILE = 0.9  # of settled overheads: the least a settled worker is charged for its overhead
MIN_FLOOR_REPORTS = 5  # fewer settled reports than this: the floor is their largest


@dataclass(frozen=True)
class SizeReport:
    """One live worker's heartbeat as the account reads it. ``whole_bytes``: the driver's count of its
    process (0: no driver figure, e.g. CPU); ``kv_bytes``, ``lora_bytes``: its KV cache and LoRA tensors;
    ``private_bytes``: its own copy of the backbone (no sharing), else 0; ``settled``: its decode graphs
    are captured (nothing lazy pending)."""

    whole_bytes: int
    kv_bytes: int
    lora_bytes: int
    private_bytes: int = 0
    settled: bool = False

    @property
    def overhead_bytes(self) -> int:
        return self.whole_bytes - self.kv_bytes - self.lora_bytes - self.private_bytes


def learned_overhead(
    reports: list[int], default_bytes: int, margin_bytes: int = OVERHEAD_MARGIN_BYTES
) -> int:
    """A worker's overhead beyond its KV cache and LoRA tensors, from what live workers report (the
    driver's count of the whole process minus those two): the largest report plus a margin, so that a
    new worker is never granted less than the biggest one already running needs; `default_bytes` while
    no worker reports (no NVML, e.g. on CPU, or none up yet). A worker to start, and one not yet settled,
    is charged this."""
    real = [r for r in reports if r > 0]
    return max(real) + margin_bytes if real else default_bytes


def overhead_floor(settled: list[int], learned_bytes: int, quantile: float = FLOOR_QUANTILE) -> int:
    """The least overhead a settled worker is charged: the ``quantile`` (nearest rank) of the settled
    workers' overheads; their largest while fewer than `MIN_FLOOR_REPORTS` report; ``learned_bytes`` when
    none does. Never above ``learned_bytes``."""
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
    real = sorted(r for r in settled if r > 0)
    if not real:
        return learned_bytes
    if len(real) < MIN_FLOOR_REPORTS:
        return min(learned_bytes, real[-1])
    rank = min(len(real) - 1, max(0, math.ceil(round(quantile * len(real), 9)) - 1))  # nearest rank
    return min(learned_bytes, real[rank])


def charge_bytes(
    report: SizeReport | None,
    estimate_bytes: int,
    floor_overhead: int,
    margin_bytes: int = OVERHEAD_MARGIN_BYTES,
) -> int:
    """What the account charges a live bound worker. ``estimate_bytes``: its size by the learned overhead
    (KV budget + LoRA + `learned_overhead`, what it was started with); ``floor_overhead``: `overhead_floor`.

    No driver report, or graphs still pending: the larger of its report and the estimate (as before).
    Settled: its own report + ``margin_bytes``, at least KV + LoRA (+ private weights) + ``floor_overhead``,
    and never more than the estimate would have been unless it reports more than that."""
    if report is None or report.whole_bytes <= 0:
        return estimate_bytes
    if not report.settled:
        return max(report.whole_bytes, estimate_bytes)
    floor = report.kv_bytes + report.lora_bytes + report.private_bytes + floor_overhead
    own = max(report.whole_bytes + margin_bytes, floor)
    return own if report.whole_bytes > estimate_bytes else min(own, estimate_bytes)


def parked_charge_bytes(
    report: SizeReport | None,
    estimate_bytes: int,
    release_bytes: int,
    lora_bytes: int,
    margin_bytes: int = OVERHEAD_MARGIN_BYTES,
) -> int:
    """What the account charges a parked worker (`PolicyConfig.park_idle`: its KV cache and graph pools
    released, its process kept). A parked worker runs nothing, so nothing of it grows: with a driver report
    it is charged that report + ``margin_bytes`` (as a settled worker, without the peers' floor: the floor's
    peers hold graph pools and KV it has given back). Without one (CPU, a container hiding host pids) it is
    charged ``estimate_bytes`` (its unparked charge) less ``release_bytes`` (what its heartbeat says the
    park freed: 0 when it does not say, then the whole estimate), never below its LoRA tensors."""
    if report is not None and report.whole_bytes > 0:
        return report.whole_bytes + margin_bytes
    return max(lora_bytes, estimate_bytes - max(0, release_bytes), 0)


def park_sizes(
    report: SizeReport | None,
    estimate_bytes: int,
    floor_overhead: int,
    release_bytes: int,
    parked: bool,
    margin_bytes: int = OVERHEAD_MARGIN_BYTES,
) -> tuple[int, int]:
    """A live bound worker's charge and its ``Worker.release_bytes`` as the account sees them: (charge,
    release). ``release_bytes``: its heartbeat's ``park_release_bytes`` (what parking frees now; parked:
    what unparking takes back), 0 when it does not say (then the release is 0 too: the policy falls back
    to ``PolicyConfig.park_release_fraction``).

    Unparked: charged `charge_bytes`; its release is that charge less what it would be charged parked
    (its report less the heartbeat's release, `parked_charge_bytes`): what a Park gives back to the
    account, not what the process frees (they differ where the charge is the estimate or the floor).
    Parked: charged `parked_charge_bytes`; its release is what it is charged once unparked (its report +
    the release, graphs pending again: `charge_bytes`' unsettled rule) less that."""
    lora = report.lora_bytes if report is not None else 0
    if not parked:
        charge = charge_bytes(report, estimate_bytes, floor_overhead, margin_bytes)
        if release_bytes <= 0:
            return charge, 0
        after = None
        if report is not None and report.whole_bytes > 0:
            after = SizeReport(
                max(0, report.whole_bytes - release_bytes), 0, report.lora_bytes, report.private_bytes, True
            )
        parked_charge = parked_charge_bytes(after, charge, release_bytes, lora, margin_bytes)
        return charge, max(0, charge - parked_charge)
    charge = parked_charge_bytes(report, estimate_bytes, release_bytes, lora, margin_bytes)
    if release_bytes <= 0:
        return charge, 0
    back = None
    if report is not None and report.whole_bytes > 0:
        back = SizeReport(
            report.whole_bytes + release_bytes, release_bytes, report.lora_bytes, report.private_bytes, False
        )
    unparked = charge_bytes(back, estimate_bytes, floor_overhead, margin_bytes)
    return charge, max(0, unparked - charge)
