"""What several components must agree on, in one settings base (environment variables `LORAFN_*`).

The gateway, the worker, the controller, the operator and `lorafn up` each have one typed settings class;
the fields that must match across them (where Redis is, the key prefix, how long a heartbeat keeps a
worker live, where caches live) are defined once here and inherited, so a deployment sets them once
(`LORAFN_REDIS_URL`, `LORAFN_KEY_PREFIX`, `LORAFN_HEARTBEAT_TTL_S`, `LORAFN_CACHE_DIR`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "LORAFN_"


def default_cache_dir() -> Path:
    """$LORAFN_CACHE_DIR, else $XDG_CACHE_HOME/lorafn, else ~/.cache/lorafn."""
    explicit = os.environ.get(f"{ENV_PREFIX}CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lorafn"


class SharedSettings(BaseSettings):
    """The fields every component reads the same way. Subclass it; add the component's own fields."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="the data plane's Redis")
    key_prefix: str = Field(default="lorafn", description="key prefix of this deployment in Redis")
    heartbeat_ttl_s: float = Field(
        default=5.0, gt=0, description="a worker is live while its last heartbeat is younger than this"
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="models, KV-init records and graph archives ($XDG_CACHE_HOME/lorafn by default)",
    )


def env_name(field: str) -> str:
    """The environment variable of a settings field (`redis_url` -> `LORAFN_REDIS_URL`)."""
    return f"{ENV_PREFIX}{field.upper()}"


def _function_keep_alive(value: object) -> object:
    """ "function" is None (its function's keep-alive); seconds and "inf" pass on to the float."""
    return None if value == "function" else value


# The parked keep-alive of `lorafn up` and of the controller (PolicyConfig.parked_keep_alive_s), one field for
# both: 300 s since the 10-minute H100 replay (docs/benchmarks.md).
PARKED_KEEP_ALIVE_S = 300.0
ParkedKeepAlive = Annotated[
    Annotated[float, Field(ge=0)] | None,
    BeforeValidator(_function_keep_alive),
    Field(
        description="a parked worker exits once idle this long (seconds, or inf: never: only offloading "
        'stops it; "function" or null: its function\'s keep-alive, as an unparked worker); 300 s since the '
        "10-minute H100 replay (PolicyConfig.parked_keep_alive_s, docs/benchmarks.md)",
    ),
]


def _never_is_inf(value: object) -> object:
    """ "never" is inf (park only under memory pressure); seconds and "inf" pass on to the float."""
    return float("inf") if value == "never" else value


# When an idle bound worker parks without memory pressure, for `lorafn up` and the controller
# (PolicyConfig.park_after_s): 50 s since the 10-minute H100 replays of the seventeenth session (SLO
# violations 5.7% -> 3.5%, fresh starts 83 -> 35, GPU-seconds +5%; docs/benchmarks.md).
PARK_AFTER_S = 50.0
ParkAfter = Annotated[
    Annotated[float, Field(gt=0)] | None,
    BeforeValidator(_never_is_inf),
    Field(
        description="also park a bound worker idle this long (seconds) without memory pressure, so that the "
        'warm pool gets its memory; inf, "never" or null: only under pressure; 50 s since the 10-minute H100 '
        "replays (PolicyConfig.park_after_s, docs/benchmarks.md; needs park_idle)",
    ),
]


# The burst KV budget of `lorafn up` and of the controller (PolicyConfig.burst_kv_bytes), one field for both.
BurstKvMiB = Annotated[
    int,
    Field(
        ge=0,
        description="the KV budget (MiB) the busy workers of a function whose online requests wait in its "
        "queue may grow to, out of GPU memory online demand left (keeping room for one more standby); back "
        "to its function's budget once idle; 0: off (PolicyConfig.burst_kv_bytes)",
    ),
]


# Scale-up on a queue's wait, for `lorafn up` and the controller (PolicyConfig.scale_up_wait_fraction).
ScaleUpWaitFraction = Annotated[
    float | None,
    Field(
        gt=0,
        le=1,
        description="also add a worker to a function whose oldest queued request has waited this share of "
        "its TTFT SLO behind busy workers (one per round, up to maxReplicas); unset: only by queue length "
        "(PolicyConfig.scale_up_wait_fraction)",
    ),
]


def token_buckets(text: str) -> tuple[int, ...]:
    """Prefill-graph buckets (the worker's and the operator's `prefill_graph_tokens`): "512, 128" -> (128,
    512); "" -> (). ValueError naming the setting for anything but token counts of at least 2."""
    try:
        buckets = tuple(sorted({int(part) for part in text.replace(" ", "").split(",") if part}))
    except ValueError:
        raise ValueError(f"prefill_graph_tokens: comma-separated token counts, got {text!r}") from None
    if any(b < 2 for b in buckets):
        raise ValueError(f"prefill_graph_tokens: buckets of at least 2 tokens, got {text!r}")
    return buckets


def normalized_token_buckets(text: str) -> str:
    """`token_buckets` written back: "512, 128" -> "128,512" (what a settings field keeps)."""
    return ",".join(map(str, token_buckets(text)))


# Prefill-graph buckets as a settings field keeps them ("128,512"), checked where they are set (the worker's
# and the operator's `prefill_graph_tokens`)
TokenBuckets = Annotated[str, AfterValidator(normalized_token_buckets)]
