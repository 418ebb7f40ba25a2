"""The knobs of the policy (one typed config; the driver fills it from its settings)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    """
    - ``gpu_utilization``: fraction of each GPU's memory the account may grant (the rest absorbs
      allocator fragmentation and CUDA's own growth).
    - ``scale_up_queue_per_worker``: queued requests per live worker above which a function gets
      one more worker per round (up to ``max_replicas``).
    - ``backoff_base_s``, ``backoff_cap_s``: failed starts wait base, 2 base, 4 base, ... up to cap.
    - ``min_standby_probability``: the k-th standby of a shape is worth keeping only while the chance
      of k or more cold arrivals within one refill time is at least this.
    - ``refill_s``: time to bring a new standby up (None: ``Costs.fresh_start_s``).
    - ``warm_pool``: keep standby workers (pre-loading); off, every cold start is a fresh process (the
      trace replay's "no warm pool" ablation).
    - ``pool_min_age_s``: a surplus standby younger than this (its age known) is kept while memory allows,
      not stopped: it was started for a reason moments ago, and stopping it wastes that start (seen as
      standbys started and stopped within a second when cold demand flickered between rounds).
    - ``batch_backlog_per_worker``: a function with an offline batch backlog (``Function.batch_backlog``:
      requests its live workers had no room for) wants one more worker per this many of them (up to
      ``max_replicas``) and gets them by binding
      ready standbys only: never a fresh start, an offload or a claim on a warming standby (those are for
      online demand); they return through keep-alive once the backlog is gone. The batch runner's in-flight
      cap per worker (48) is the natural value.
    - ``offloading``: stop standby or idle bound workers to make room for a cold start; off, a function
      that does not fit waits for memory to free up by itself (the "no offloading" ablation).
    """

    gpu_utilization: float = 0.92
    scale_up_queue_per_worker: float = 4.0
    backoff_base_s: float = 2.0
    backoff_cap_s: float = 300.0
    min_standby_probability: float = 0.01
    refill_s: float | None = None
    warm_pool: bool = True
    offloading: bool = True
    pool_min_age_s: float = 30.0
    batch_backlog_per_worker: float = 48.0

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_utilization <= 1.0:
            raise ValueError(f"gpu_utilization must be in (0, 1], got {self.gpu_utilization!r}")
        if not self.scale_up_queue_per_worker > 0:
            raise ValueError(f"scale_up_queue_per_worker must be > 0, got {self.scale_up_queue_per_worker!r}")
        if not 0 <= self.backoff_base_s <= self.backoff_cap_s:
            raise ValueError(
                f"need 0 <= backoff_base_s <= backoff_cap_s, got backoff_base_s={self.backoff_base_s!r}, "
                f"backoff_cap_s={self.backoff_cap_s!r}"
            )
        if not 0.0 < self.min_standby_probability <= 1.0:
            raise ValueError(
                f"min_standby_probability must be in (0, 1], got {self.min_standby_probability!r}"
            )
        if not self.batch_backlog_per_worker > 0:
            raise ValueError(f"batch_backlog_per_worker must be > 0, got {self.batch_backlog_per_worker!r}")
        if not self.pool_min_age_s >= 0:
            raise ValueError(f"pool_min_age_s must be >= 0, got {self.pool_min_age_s!r}")
        if self.refill_s is not None and not self.refill_s > 0:
            raise ValueError(f"refill_s must be > 0 or None, got {self.refill_s!r}")
