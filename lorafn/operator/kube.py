"""The operator's Kubernetes API edge: a few REST calls (get, list, create, delete).

kopf watches and patches our own resources; this small client does the rest (pods, services, claims,
nodes, secrets) over plain HTTP, so that it behaves the same against a real API server and KMock.
Credentials come from the same place kopf's come from (`connection()`): in-cluster service account,
then kubeconfig, or an explicit server URL (tests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from lorafn.operator.config import OperatorConfig


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Conflict(KubeError):
    """409: the object exists already or changed under us; retry later."""


@dataclass(frozen=True)
class Connection:
    server: str
    token: str | None = None
    ca_path: str | None = None
    insecure: bool = False
    cert_path: str | None = None
    key_path: str | None = None


def connection(config: OperatorConfig) -> Connection:
    """An explicit server (LORAFN_OPERATOR_KUBE_SERVER), else in-cluster, else the kubeconfig."""
    if config.kube_server:
        return Connection(
            server=config.kube_server, token=config.kube_token or None, insecure=config.kube_insecure
        )
    import kubernetes.client
    import kubernetes.config

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    cfg = kubernetes.client.Configuration.get_default_copy()
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    token = header.split(" ", 1)[-1] if header else None
    return Connection(
        server=cfg.host,
        token=token,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        cert_path=cfg.cert_file,
        key_path=cfg.key_file,
    )


class Kube:
    """Synchronous; the handlers that use it are synchronous and run in kopf's thread pool."""

    def __init__(self, conn: Connection, timeout_s: float = 15.0) -> None:
        verify: Any = False if conn.insecure else (conn.ca_path or True)
        cert = (conn.cert_path, conn.key_path) if conn.cert_path and conn.key_path else None
        headers = {"Accept": "application/json"}
        if conn.token:
            headers["Authorization"] = f"Bearer {conn.token}"
        self._http = httpx.Client(
            base_url=conn.server, verify=verify, cert=cert, headers=headers, timeout=timeout_s
        )

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, path, **kwargs)
        if response.status_code == 409:
            raise Conflict(409, _message(response))
        if response.status_code >= 400 and response.status_code != 404:
            raise KubeError(response.status_code, _message(response))
        return response

    def get(self, path: str) -> dict[str, Any] | None:
        response = self._call("GET", path)
        return None if response.status_code == 404 else response.json()

    def list(self, path: str, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Items of a collection; the label filter is applied here too, so a server that ignores
        `labelSelector` (a mock) gives the same answer as a real one."""
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} if labels else None
        response = self._call("GET", path, params=params)
        if response.status_code == 404:
            return []
        items = response.json().get("items") or []
        if labels:
            items = [
                i
                for i in items
                if all(((i.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())
            ]
        return items

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._call(
            "POST", path, content=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        if response.status_code == 404:
            raise KubeError(404, f"POST {path}: {_message(response)}")
        return response.json()

    def ensure(self, path: str, body: dict[str, Any]) -> bool:
        """Create unless an object of that name exists; True when created."""
        name = body["metadata"]["name"]
        if self.get(f"{path}/{name}") is not None:
            return False
        try:
            self.create(path, body)
        except Conflict:
            return False
        return True

    def delete(self, path: str) -> bool:
        """Delete (background propagation); False when it was already gone."""
        response = self._call("DELETE", path, params={"propagationPolicy": "Background"})
        return response.status_code != 404


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("message") or response.text)
    except ValueError:
        return response.text[:500]


# Paths of the collections the operator touches.
def pods(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods"


def services(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/services"


def secret(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/secrets/{name}"


NODES = "/api/v1/nodes"


def resource_claims(config: OperatorConfig) -> str:
    return f"/apis/{config.dra_api_version}/namespaces/{config.namespace}/resourceclaims"


def backbone(name: str) -> str:
    return f"/apis/lorafn.io/v1alpha1/backbones/{name}"
