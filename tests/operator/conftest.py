"""Fixtures of the operator tests: a real redis-server, a KMock Kubernetes API, the operator process."""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.signals import sigint_default

NAMESPACE = "lorafn-system"


@pytest.fixture
def redis_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A real redis-server: the suite's shared `redis_server` fixture when there is one, else our own."""
    try:
        server = request.getfixturevalue("redis_server")
    except pytest.FixtureLookupError:
        server = None
    if server is not None:
        yield getattr(server, "url", server)
        return
    from lorafn.local.redis_proc import RedisProcess

    proc = RedisProcess(data_dir=tmp_path / "redis").start()
    try:
        yield proc.url
    finally:
        proc.stop()


def stamp(body: dict[str, Any]) -> dict[str, Any]:
    """What an API server adds on create (KMock stores bodies as given)."""
    meta = body.setdefault("metadata", {})
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("resourceVersion", "1")
    meta.setdefault("generation", 1)
    meta.setdefault(
        "creationTimestamp", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    )
    return body


class Cluster:
    """KMock's Kubernetes emulator on a real HTTP port, and a client that talks to it over HTTP."""

    def __init__(self, km: Any, url: str, session: aiohttp.ClientSession) -> None:
        self.km, self.url, self.http = km, url, session

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(f"{self.url}{path}", json=stamp(body)) as response:
            assert response.status < 300, await response.text()
            return await response.json()

    async def patch(self, path: str, patch: dict[str, Any]) -> None:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.http.patch(f"{self.url}{path}", json=patch, headers=headers) as response:
            assert response.status < 300, await response.text()

    async def delete(self, path: str) -> None:
        async with self.http.delete(f"{self.url}{path}") as response:
            assert response.status < 300, await response.text()

    async def get(self, path: str) -> dict[str, Any] | None:
        async with self.http.get(f"{self.url}{path}") as response:
            return None if response.status == 404 else await response.json()

    async def items(self, path: str, **labels: str) -> list[dict[str, Any]]:
        body = await self.get(path)
        items = (body or {}).get("items") or []
        return [
            i for i in items if all(i["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())
        ]

    async def pods(self, **labels: str) -> list[dict[str, Any]]:
        return await self.items(f"/api/v1/namespaces/{NAMESPACE}/pods", **labels)

    async def set_pod_ready(self, name: str) -> None:
        """Play the kubelet: the pod runs and its readiness probe passes."""
        status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        await self.patch(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", {"status": status})

    def posted_events(self) -> list[dict[str, Any]]:
        """Every Event the operator posted (KMock keeps all requests; generateName objects overwrite)."""
        import kmock

        return [
            req.data
            for req in self.km
            if req.method == kmock.method.POST
            and req.url.path.endswith("/events")
            and isinstance(req.data, dict)
        ]

    def versions(self, resource: str, namespace: str | None, name: str) -> int:
        """How many times the object was written (KMock keeps every version)."""
        return len(self.km.objects[resource, namespace, name].history)


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    import kmock

    async with kmock.KubernetesEmulator() as km, kmock.Server(km) as server:
        verbs = {"get", "list", "watch", "create", "patch", "delete"}
        km.resources["lorafn.io/v1alpha1/backbones"] = kmock.ResourceInfo(
            kind="Backbone",
            singular="backbone",
            namespaced=False,
            subresources={"status"},
            verbs=verbs,
            shortnames={"bb"},
        )
        km.resources["lorafn.io/v1alpha1/lorafunctions"] = kmock.ResourceInfo(
            kind="LoRAFunction",
            singular="lorafunction",
            namespaced=True,
            subresources={"status"},
            verbs=verbs,
            shortnames={"lfn"},
        )
        for plural, kind, namespaced in [
            ("pods", "Pod", True),
            ("services", "Service", True),
            ("secrets", "Secret", True),
            ("events", "Event", True),
            ("nodes", "Node", False),
            ("namespaces", "Namespace", False),
        ]:
            km.resources[f"v1/{plural}"] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=verbs)
        async with aiohttp.ClientSession() as session:
            yield Cluster(km, str(server.url).rstrip("/"), session)


class OperatorProcess:
    """`lorafn operator run`, the real command, as a child process pointed at KMock and Redis."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        handle = self.log.open("a")
        handle.write(f"\n===== start {self.starts} =====\n")
        handle.flush()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "lorafn.cli",
            "operator",
            "run",
            "--liveness",
            "",
            "--verbose",
            env=self.env,
            stdout=handle,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=sigint_default,
        )

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


@pytest_asyncio.fixture
async def start_operator(
    cluster: Cluster, redis_url: str, tmp_path: Path
) -> AsyncIterator[Callable[..., Any]]:
    procs: list[OperatorProcess] = []

    async def start(**extra_env: str) -> OperatorProcess:
        env = dict(os.environ)
        env.update(
            LORAFN_OPERATOR_KUBE_SERVER=cluster.url,
            LORAFN_OPERATOR_REDIS_URL=redis_url,
            LORAFN_OPERATOR_NAMESPACE=NAMESPACE,
            LORAFN_OPERATOR_RECONCILE_INTERVAL_S="0.5",
            LORAFN_OPERATOR_PVC_ROOT=str(tmp_path / "pvc"),
            LORAFN_OPERATOR_FILE_ROOT=str(tmp_path),  # file:// models/adapters of the tests (issue 15)
            LORAFN_OPERATOR_GATEWAY_URL="http://lorafn-gateway.lorafn-system.svc.cluster.local",
            **extra_env,
        )
        op = OperatorProcess(env, tmp_path / "operator.log")
        await op.start()
        procs.append(op)
        return op

    yield start
    for op in procs:
        await op.stop()


async def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll an async or sync predicate until it returns something truthy."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while asyncio.get_running_loop().time() < deadline:
        last = predicate()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")
