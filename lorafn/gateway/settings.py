"""The gateway's one typed configuration (environment variables `LORAFN_*`).

`redis_url`, `key_prefix` and `heartbeat_ttl_s` come from `lorafn.api.settings.SharedSettings`: workers,
the controller and the operator read the same fields, so a deployment sets them once.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from lorafn.api.settings import SharedSettings


class GatewaySettings(SharedSettings):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)

    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="larger request bodies get 413")
    max_tokens_limit: int = Field(default=32_768, ge=1, description="hard cap on max_tokens")
    max_prompt_bytes_per_token: int = Field(
        default=32,
        ge=4,
        description="a prompt over context x this many bytes is refused before it is tokenized",
    )
    default_max_context: int = Field(
        default=2048, ge=16, description="when neither registry nor config.json says"
    )

    rate_limit_rps: float = Field(default=50.0, description="per function, token bucket; <= 0 disables")
    rate_limit_burst: int = Field(default=100, ge=1)
    max_queue: int = Field(default=1000, ge=0, description="queued requests per function before 503; 0: none")

    queue_timeout_s: float = Field(default=30.0, gt=0, description="a live worker must accept within this")
    cold_start_timeout_s: float = Field(
        default=120.0, gt=0, description="... or, with none live, within this"
    )
    request_timeout_s: float = Field(default=600.0, gt=0, description="a whole request, first byte to last")
    demand_guard_ms: int = Field(
        default=2000, ge=1, description="at most one demand record per function per period"
    )
    registry_cache_s: float = Field(default=2.0, ge=0, description="how long a function record is reused")

    # slow clients (slowloris): lorafn/gateway/server.py
    header_timeout_s: float = Field(default=10.0, gt=0, description="each request's headers, from connect")
    body_timeout_s: float = Field(default=30.0, gt=0, description="the whole body, once the headers are in")
    keep_alive_s: float = Field(default=5.0, gt=0, description="idle keep-alive connections are closed")
    max_http_connections: int = Field(
        default=2000, ge=1, description="open connections; beyond it new requests get 503 at once"
    )

    max_connections: int = Field(
        default=1024, ge=4, description="Redis connections (one per waiting request)"
    )
    metrics_per_function: bool = Field(
        default=False,
        description="label /metrics by function name (it needs no key: off, names are not listed)",
    )
    log_level: str = "info"
    request_log: bool = Field(
        default=True,
        description="log one line per invocation: received -> authorized -> enqueued -> accepted -> first "
        "delta -> done (ms)",
    )
    freeze_heap: bool = Field(
        default=True,
        description="after the first keep-warm pass, one full garbage collection and gc.freeze(): later "
        "full collections skip what the process holds (off for gateways embedded in a test process)",
    )
    keep_warm_s: float = Field(
        default=5.0,
        ge=0,
        description="how often registered backbones' tokenizers are loaded ahead of their first request; "
        "0: never (a function's first request loads it)",
    )

    # offline batches (the OpenAI Files and Batch API; docs/batch.md)
    files_dir: Path | None = Field(
        default=None,
        description="the file store of batch input/output files (default <cache_dir>/files; lorafn up: "
        "<state>/files; Kubernetes: a volume shared by the gateway replicas)",
    )
    max_file_bytes: int = Field(default=100 << 20, ge=1024, description="larger uploads get 413")
    max_batch_requests: int = Field(default=50_000, ge=1, description="lines of one batch input file")
    batch_runner: bool = Field(
        default=True, description="run the batch runner in this process (active under a lease)"
    )
    batch_tick_s: float = Field(default=0.2, gt=0, description="how often the runner reads replies and packs")
    batch_max_inflight_per_worker: int = Field(
        default=48,
        ge=1,
        description="batch requests in flight per live worker (below its max_running: slots left for online)",
    )
    batch_retries: int = Field(default=2, ge=0, description="resubmissions of a batch request that failed")
    batch_kv_overcommit: float = Field(
        default=0.0,
        ge=0,
        description="pack batch waves this fraction beyond the workers' KV budgets, within their host KV "
        "budgets (the overflow is swapped to host memory; docs/batch.md)",
    )

    def file_store_dir(self) -> Path:
        return self.files_dir or self.cache_dir / "files"
