"""The parts of one gateway app, built once by `create_app` and reached by the routes through
`request.app.state.gateway` (the FastAPI templates' `deps` module)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from lorafn.gateway.admission import Admitter
from lorafn.gateway.errors import APIError
from lorafn.gateway.metrics import Metrics
from lorafn.gateway.relay import Relay
from lorafn.gateway.settings import GatewaySettings
from lorafn.store import AsyncStore, Keys


@dataclass(frozen=True)
class Gateway:
    settings: GatewaySettings
    store: AsyncStore
    keys: Keys
    metrics: Metrics
    admitter: Admitter
    relay: Relay
    # /readyz's own connection: with every request connection taken by waiting requests, the gateway
    # is busy, not unready
    health: AsyncStore

    @classmethod
    def create(cls, settings: GatewaySettings, store: AsyncStore | None = None) -> Gateway:
        store = store or AsyncStore(settings.redis_url, max_connections=settings.max_connections)
        keys, metrics = Keys(settings.key_prefix), Metrics(per_function=settings.metrics_per_function)
        return cls(
            settings,
            store,
            keys,
            metrics,
            Admitter(settings, store, keys, metrics),
            Relay(settings, store, keys, metrics),
            AsyncStore(store.url, socket_timeout_s=2.0, max_connections=2),
        )

    def count_error(self, error: APIError) -> None:
        self.metrics.errors.labels(error.code or str(error.status)).inc()


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway
