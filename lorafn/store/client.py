"""Running store operations on a sync or an asyncio Redis client, with the same operation objects.

An `Op` queues its commands on a redis-py pipeline and parses their replies. Sync and asyncio pipelines
have the same command methods, so every operation is written once (in `registry`, `streams`,
`workers`, `stats`) and runs on `Store` (workers, CLI) or `AsyncStore` (the gateway). `combine` puts
several operations in one round trip.

Lua scripts live as `.lua` files next to this module and are sent with EVAL: Redis caches them by
digest, and EVAL keeps working after a Redis restart emptied its script cache (EVALSHA would not).
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, TypeVar

import redis
import redis.asyncio

T = TypeVar("T")

# Errors that mean "Redis is not reachable right now" (as opposed to a bad command).
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    ConnectionError,
    TimeoutError,
)


@cache
def script(name: str) -> str:
    """The text of `lua/<name>.lua`."""
    return importlib.resources.files("lorafn.store").joinpath("lua", f"{name}.lua").read_text()


def eval_script(pipe: Any, name: str, keys: list[str], args: list[Any]) -> None:
    """Queue `EVAL <lua/name.lua> len(keys) *keys *args` on a pipeline."""
    pipe.eval(script(name), len(keys), *keys, *args)


@dataclass(frozen=True)
class Op(Generic[T]):
    """Commands to queue (`build(pipe)`) and how to turn their replies into a result (`parse`)."""

    build: Callable[[Any], None]
    parse: Callable[[list[Any]], T]

    def map(self, f: Callable[[T], Any]) -> Op[Any]:
        return Op(self.build, lambda replies: f(self.parse(replies)))


def combine(*ops: Op[Any]) -> Op[tuple[Any, ...]]:
    """One round trip for several operations; the result is the tuple of their results."""
    sizes: list[int] = []

    def build(pipe: Any) -> None:
        sizes.clear()
        for op in ops:
            before = len(pipe.command_stack)
            op.build(pipe)
            sizes.append(len(pipe.command_stack) - before)

    def parse(replies: list[Any]) -> tuple[Any, ...]:
        out, start = [], 0
        for op, size in zip(ops, sizes, strict=True):
            out.append(op.parse(replies[start : start + size]))
            start += size
        return tuple(out)

    return Op(build, parse)


def _client_kwargs(socket_timeout_s: float) -> dict[str, Any]:
    return {
        "decode_responses": True,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": min(socket_timeout_s, 2.0),
        "health_check_interval": 0,
    }


class Store:
    """A sync Redis client that runs `Op`s (the worker, the CLI, tests)."""

    def __init__(self, url: str, socket_timeout_s: float = 10.0, max_connections: int | None = None) -> None:
        self.url = url
        self.client = redis.Redis.from_url(
            url, max_connections=max_connections, **_client_kwargs(socket_timeout_s)
        )

    def run(self, op: Op[T]) -> T:
        pipe = self.client.pipeline(transaction=False)
        op.build(pipe)
        return op.parse(pipe.execute())

    def ping(self) -> bool:
        return bool(self.client.ping())

    def close(self) -> None:
        self.client.close()


class AsyncStore:
    """An asyncio Redis client that runs `Op`s (the gateway).

    A bounded, blocking pool: requests that wait on their reply stream each hold a connection while
    they block, so `max_connections` bounds the concurrent requests one gateway process relays.
    """

    def __init__(self, url: str, socket_timeout_s: float = 10.0, max_connections: int = 1024) -> None:
        self.url = url
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=socket_timeout_s, **_client_kwargs(socket_timeout_s)
        )
        self.client = redis.asyncio.Redis(connection_pool=pool)

    async def run(self, op: Op[T]) -> T:
        pipe = self.client.pipeline(transaction=False)
        op.build(pipe)
        return op.parse(await pipe.execute())

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    async def close(self) -> None:
        await self.client.aclose()
