"""Prometheus metrics of one backbone server and its small HTTP endpoint (/healthz, /readyz, /metrics)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_loaded = Gauge(
            "lorafn_backbone_bytes_loaded", "Backbone bytes loaded (W's used size)", registry=r
        )
        self.mapped_bytes = Gauge("lorafn_backbone_mapped_bytes", "Bytes of memory backing W", registry=r)
        self.load_seconds = Gauge("lorafn_backbone_load_seconds", "Seconds the last load took", registry=r)
        self.load_gbps = Gauge(
            "lorafn_backbone_load_gbps", "Load throughput of the last load, GB/s", registry=r
        )
        self.h2d_gbps = Gauge("lorafn_backbone_h2d_gbps", "Measured pinned host-to-device GB/s", registry=r)
        self.attached = Gauge("lorafn_backbone_attached_workers", "Workers holding a lease now", registry=r)
        self.attaches = Counter("lorafn_backbone_attaches", "Attaches granted", registry=r)
        self.detaches = Counter("lorafn_backbone_detaches", "Leases ended", ["reason"], registry=r)
        self.refusals = Counter("lorafn_backbone_refusals", "Requests refused", ["reason"], registry=r)
        self.heartbeats = Counter("lorafn_backbone_heartbeats", "Heartbeats received", registry=r)
        self.ready = Gauge("lorafn_backbone_ready", "1 when loaded and serving", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HealthServer:
    """Serves /healthz (alive), /readyz (loaded and accepting workers) and /metrics in a thread."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: ServerMetrics,
        is_ready: Callable[[], bool],
        info: Callable[[], dict],
    ):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self._send(200, b'{"status":"ok"}', "application/json")
                elif path == "/readyz":
                    ready = outer.is_ready()
                    body = json.dumps({"ready": ready, **outer.info()}).encode()
                    self._send(200 if ready else 503, body, "application/json")
                elif path == "/metrics":
                    self._send(200, outer.metrics.render(), CONTENT_TYPE_LATEST)
                else:
                    self._send(404, b'{"error":"not found"}', "application/json")

        self.metrics = metrics
        self.is_ready = is_ready
        self.info = info
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="backbone-health", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
