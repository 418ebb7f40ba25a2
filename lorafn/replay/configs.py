"""The configurations a replay compares: the full platform, one ablation per switch, and the always-on
baselines. Each is `LocalConfig` settings for `lorafn up` plus changes to the registered objects. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# keepAliveSeconds of an always-on function: the longest the spec allows is not needed, the run's length is
ALWAYS_ON_KEEP_ALIVE_S = 86_400


@dataclass(frozen=True)
class ReplayConfig:
    """One row of the report: how the platform runs for it."""

    name: str
    description: str
    local: dict[str, Any] = field(default_factory=dict)  # LocalConfig settings
    min_replicas: int = 0  # every function's spec.scaling.minReplicas
    keep_alive_s: int | None = None  # every function's spec.scaling.keepAliveSeconds (None: the option's)
    # Backbone spec.warmPool (min, max) when the LocalConfig switch it stands for is missing (None: default)
    warm_pool_fallback: tuple[int, int] | None = None
    brief: str = ""  # a few words for `--configs --help` (configs_help)
    # the Backbone's spec.adapterSlots (docs/runtime.md#adapter-slots): the functions of the replay's one
    # namespace share workers of this many adapter slots (1: a worker each)
    adapter_slots: int = 1

    @property
    def shares_backbone(self) -> bool:
        return bool(self.local.get("share_backbone", True))


CONFIGS: dict[str, ReplayConfig] = {
    c.name: c
    for c in (
        # SLO admission is off by default (it made TTFT worse on the H100, docs/benchmarks.md): "full"
        # switches it on explicitly, so that the ablation rows still each take one mechanism away
        ReplayConfig(
            "full",
            "everything on: shared backbone, warm pool, offloading with parking, SLO admission",
            {"gpu_admission": True, "park_idle": True},
            brief="idle workers park after 50 s or under memory pressure",
        ),
        # parking (issue 16) is on by default since the H100 replays (docs/benchmarks.md, "Parking on the
        # H100"): this row takes it away (idle bound workers exit when memory is short, as before)
        ReplayConfig(
            "no-parking",
            "full, but idle bound workers are stopped instead of parked when memory is short "
            "(park_idle: false)",
            {"gpu_admission": True, "park_idle": False},
            brief="they exit instead",
        ),
        # the configuration measured on the H100: parked workers stay until memory is needed
        ReplayConfig(
            "parking",
            "full, and idle bound workers release their KV cache instead of exiting when memory is short "
            "(only then), parked ones staying until memory is needed (park_idle: true, parked_keep_alive_s: "
            "inf, park_after_s: never)",
            {"gpu_admission": True, "park_idle": True, "parked_keep_alive_s": "inf", "park_after_s": "never"},
            brief="full, parking only under pressure, parked workers stay until memory is needed",
        ),
        # the shipped default before the seventeenth session's H100 replays (now 50 s, LocalConfig)
        ReplayConfig(
            "park-on-pressure",
            "full, but idle bound workers park only when memory is short, not after 50 s idle "
            "(park_after_s: never)",
            {"gpu_admission": True, "park_idle": True, "park_after_s": "never"},
            brief="full, parking only under pressure: the default before",
        ),
        # the shipped parked keep-alive before the 10-minute H100 replay (now 300 s, LocalConfig)
        ReplayConfig(
            "parked-function",
            "full, but parked workers exit at their function's keep-alive instead of after 300 s idle "
            "(parked_keep_alive_s: function)",
            {"gpu_admission": True, "park_idle": True, "parked_keep_alive_s": "function"},
            brief="full, parked workers exit at the function's keep-alive",
        ),
        # the simulator's best row, "park idle 50 s + never" (docs/benchmarks.md): an idle worker parks
        # before its keep-alive instead of exiting, and parked ones are never retired
        ReplayConfig(
            "parking-50",
            "parking, and bound workers idle 50 s are parked without memory pressure too (park_after_s: 50)",
            {"gpu_admission": True, "park_idle": True, "parked_keep_alive_s": "inf", "park_after_s": 50},
            brief="parking + workers idle 50 s park without pressure",
        ),
        # KV for bursts (PolicyConfig.burst_kv_bytes, off by default): busy workers grow their KV for the
        # requests queued behind them instead of those waiting for running ones to end
        ReplayConfig(
            "burst-kv",
            "full, and the busy workers of a function whose requests queue behind them grow their KV cache, "
            "up to 1 GiB, out of free GPU memory (burst_kv_mib: 1024)",
            {"gpu_admission": True, "park_idle": True, "burst_kv_mib": 1024},
            brief="full + busy workers grow their KV for their queue",
        ),
        # issue 13: the replay's functions (one namespace) share workers of 8 adapter slots, one batch and one
        # read of the backbone a step for all of a worker's functions
        ReplayConfig(
            "slots",
            "full, and the functions share workers of 8 adapter slots (Backbone adapterSlots: 8): a cold "
            "function joins a live worker's free slot; one batch serves them all",
            {"gpu_admission": True, "park_idle": True},
            brief="full + functions share workers of 8 adapter slots",
            adapter_slots=8,
        ),
        ReplayConfig(
            "no-sharing",
            "every worker loads its own copy of the backbone (LocalConfig share_backbone: false)",
            {"share_backbone": False},
            brief="a weight copy per worker",
        ),
        ReplayConfig(
            "no-warm-pool",
            "no standby workers, no pre-loading: every cold start spawns a process (warm_pool: false)",
            {"warm_pool": False},
            warm_pool_fallback=(0, 0),
            brief="no standby workers",
        ),
        ReplayConfig(
            "no-offloading",
            "a cold start that does not fit waits instead of evicting standby/idle workers "
            "(offloading: false)",
            {"offloading": False},
            brief="a cold start that does not fit waits",
        ),
        ReplayConfig(
            "no-slo-admission",
            "no deadline-margin admission of prefills across a GPU's workers (gpu_admission: false)",
            {"gpu_admission": False},
            brief="no deadline admission across a GPU's workers",
        ),
        ReplayConfig(
            "always-on",
            "one bound worker per function from the start, never scaled to zero (minReplicas 1), "
            "shared backbone, no warm pool",
            {"warm_pool": False},
            min_replicas=1,
            keep_alive_s=ALWAYS_ON_KEEP_ALIVE_S,
            warm_pool_fallback=(0, 0),
            brief="minReplicas 1, shared backbone",
        ),
        ReplayConfig(
            "always-on-private",
            "what a user without lorafn runs: one always-on worker per function with its own copy of the "
            "weights (minReplicas 1, share_backbone: false, no warm pool)",
            {"share_backbone": False, "warm_pool": False},
            min_replicas=1,
            keep_alive_s=ALWAYS_ON_KEEP_ALIVE_S,
            warm_pool_fallback=(0, 0),
            brief="minReplicas 1, a weight copy per worker",
        ),
    )
}
DEFAULT_CONFIGS = (
    "full", "no-sharing", "no-warm-pool", "no-offloading", "no-parking", "no-slo-admission", "always-on",
)  # fmt: skip
# The baseline of cost-effectiveness (the paper's vLLM = 1), in order of preference.
BASELINES = ("always-on-private", "always-on")


def configs_help() -> str:
    """`--configs`'s help: every configuration with its brief, and what 'default' and 'all' hold."""
    rows = ", ".join(f"{c.name} ({c.brief})" if c.brief else c.name for c in CONFIGS.values())
    left_out = [n for n in CONFIGS if n not in DEFAULT_CONFIGS]
    return (
        f"Comma-separated configurations, each a platform of its own and a row: {rows}; 'default' = all but "
        f"{', '.join(left_out)}; 'all'. A switch this build's LocalConfig lacks makes its row n/a."
    )


def select_configs(names: str | Sequence[str]) -> list[ReplayConfig]:
    """`full,no-sharing` (or `all`, or `default`) -> the configurations, in the order given."""
    wanted = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    out: list[ReplayConfig] = []
    for name in wanted:
        if name == "all":
            out += [c for c in CONFIGS.values() if c not in out]
        elif name == "default":
            out += [CONFIGS[n] for n in DEFAULT_CONFIGS if CONFIGS[n] not in out]
        elif name in CONFIGS:
            if CONFIGS[name] not in out:
                out.append(CONFIGS[name])
        elif name:
            raise ValueError(f"configs: unknown {name!r}; choose from all, default, {', '.join(CONFIGS)}")
    if not out:
        raise ValueError("configs: none given")
    return out


def resolve(config: ReplayConfig, available: Iterable[str]) -> tuple[dict[str, Any], bool, str | None]:
    """(LocalConfig settings, whether the Backbone warm-pool fallback applies, why it cannot run or None)
    for a platform whose LocalConfig has the fields `available`. A switch the platform lacks makes the
    row unavailable, except the warm pool, which the Backbone's spec.warmPool = 0/0 also turns off."""
    fields = set(available)
    local = {k: v for k, v in config.local.items() if k in fields}
    missing = sorted(set(config.local) - fields)
    fallback = config.warm_pool_fallback is not None and "warm_pool" in missing
    if fallback:
        missing.remove("warm_pool")
    if missing:
        return local, fallback, f"this platform's LocalConfig has no {', '.join(missing)}"
    return local, fallback, None
