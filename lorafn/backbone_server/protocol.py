"""The wire protocol between the backbone server and its workers.

One Unix stream socket per worker. Each message is a 4-byte big-endian length followed by that many
bytes of UTF-8 JSON (an object). File descriptors travel as SCM_RIGHTS ancillary data on the first
bytes of the reply that carries them (only `attach` replies carry fds). Every message names the
protocol version (`"v"`); a server refuses other versions with an error reply, never silently.

Requests:  {"v": 1, "op": "hello" | "attach" | "heartbeat" | "detach" | "stats", ...}
Replies:   {"v": 1, "ok": true, ...}  or  {"v": 1, "ok": false, "error": {"code": str, "message": str}}
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
from typing import Any

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 1 << 20  # a worker's request: small JSON
MAX_REPLY_BYTES = 256 << 20  # a reply: the manifest of a very large model stays far below this
MAX_FDS = 253  # SCM_MAX_FD on Linux


class ProtocolError(Exception):
    """The peer sent something that is not a valid message (bad length, bad JSON, wrong version)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class PeerClosed(ProtocolError):
    """The peer closed the connection (cleanly between messages, or in the middle of one)."""

    def __init__(self, message: str = "peer closed the connection"):
        super().__init__("closed", message)


class RemoteError(RuntimeError):
    """The server answered with an error reply; `code` says which refusal (`gpu_mismatch`, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"backbone server refused ({code}): {message}")
        self.code = code
        self.message = message


def encode(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def send_message(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    data = encode(obj)
    if fds:
        if len(fds) > MAX_FDS:
            raise ValueError(f"{len(fds)} fds exceed SCM_MAX_FD ({MAX_FDS})")
        # The fds ride on the first sendmsg; a large body may need more writes after it.
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def recv_message(
    sock: socket.socket, max_bytes: int = MAX_REQUEST_BYTES, max_fds: int = 0
) -> tuple[dict[str, Any], list[int]]:
    """One message and the fds that came with it. Raises PeerClosed or ProtocolError.

    Received fds are owned by the caller; on any error they are closed here.
    """
    fds: list[int] = []
    buf = bytearray()
    need = HEADER.size
    length: int | None = None
    anc_space = socket.CMSG_SPACE(max_fds * 4) if max_fds else 0
    try:
        while True:
            while len(buf) < need:
                if anc_space:
                    chunk, anc, flags, _ = sock.recvmsg(min(need - len(buf), 1 << 20), anc_space)
                    for level, kind, payload in anc:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            usable = len(payload) - len(payload) % 4
                            fds.extend(array.array("i", payload[:usable]))
                    if flags & socket.MSG_CTRUNC:
                        raise ProtocolError("too_many_fds", f"more than {max_fds} file descriptors arrived")
                else:
                    chunk = sock.recv(min(need - len(buf), 1 << 20))
                if not chunk:
                    if buf or length is not None:
                        raise PeerClosed(
                            f"peer closed the connection mid-message ({len(buf)} of {need} bytes)"
                        )
                    raise PeerClosed()
                buf += chunk
            if length is None:
                (length,) = HEADER.unpack(bytes(buf[: HEADER.size]))
                if length > max_bytes:
                    raise ProtocolError(
                        "message_too_large", f"length prefix {length} exceeds {max_bytes} bytes"
                    )
                if length == 0:
                    raise ProtocolError("bad_message", "empty message")
                buf.clear()
                need = length
                continue
            break
        try:
            obj = json.loads(bytes(buf).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError("bad_json", f"message is not UTF-8 JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ProtocolError("bad_message", f"message must be a JSON object, got {type(obj).__name__}")
        if obj.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(
                "protocol_version",
                f"protocol version {obj.get('v')!r} is not supported (this side speaks {PROTOCOL_VERSION})",
            )
        return obj, fds
    except BaseException:
        _close_all(fds)
        raise


def ok(**fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": True, **fields}


def error(code: str, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": False, "error": {"code": code, "message": message}}


def request(
    sock: socket.socket, op: str, max_fds: int = 0, **fields: Any
) -> tuple[dict[str, Any], list[int]]:
    """Send one request and wait for its reply. An error reply raises RemoteError."""
    send_message(sock, {"v": PROTOCOL_VERSION, "op": op, **fields})
    reply, fds = recv_message(sock, MAX_REPLY_BYTES, max_fds)
    if not reply.get("ok"):
        _close_all(fds)
        err = reply.get("error") or {}
        raise RemoteError(str(err.get("code", "unknown")), str(err.get("message", "no message")))
    return reply, fds
