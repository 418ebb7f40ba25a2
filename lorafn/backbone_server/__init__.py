"""lorafn.backbone_server: one read-only copy of the base weights per GPU (or in shared memory on CPU),
mapped zero-copy into every worker.

- `server.BackboneServer`: loads a model directory once and serves manifest + fds over a Unix socket.
- `client.SharedWeightSource`: the worker side, a `lorafn.runtime.weights.WeightSource`.
- `csrc/ipc` (`lorafn._ipc`): the native VMM export/import at a fixed address.

See docs/backbone_server.md. Submodules are imported lazily (torch is heavy).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackboneServer", "ServerConfig", "SharedWeightSource"]


def __getattr__(name: str) -> Any:
    if name in ("BackboneServer", "ServerConfig"):
        from lorafn.backbone_server import server

        return getattr(server, name)
    if name == "SharedWeightSource":
        from lorafn.backbone_server.client import SharedWeightSource

        return SharedWeightSource
    raise AttributeError(name)
