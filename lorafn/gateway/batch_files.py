"""The platform's file store for batch files (docs/batch.md#where-files-live), and the multipart reader of
`POST /v1/files`.

A directory (`GatewaySettings.file_store_dir()`): `lorafn up` puts it under its state dir; on Kubernetes
it is a volume mounted by every gateway replica. Content is written to a temporary name and renamed, so a
reader never sees half a file. Records (owner, size, name) live in Redis (`lorafn.store.batches`).
"""

from __future__ import annotations

import os
import secrets
from email import policy
from email.parser import BytesParser
from pathlib import Path

from lorafn.gateway.errors import bad_request


def new_id(prefix: str) -> str:
    """`file-<24 hex>` / `batch_<24 hex>`: unguessable (ownership is also checked on every read)."""
    return f"{prefix}{secrets.token_hex(12)}"


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, name: str) -> Path:
        if "/" in name or name.startswith("."):
            raise ValueError(f"file name {name!r} must be a plain name")
        return self.root / name

    def write(self, name: str, data: bytes) -> Path:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.path(name)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def read(self, path: str | Path) -> bytes:
        return Path(path).read_bytes()

    def delete(self, path: str | Path) -> None:
        Path(path).unlink(missing_ok=True)


def parse_upload(content_type: str | None, body: bytes) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """The text fields and the (filename, bytes) of the `file` part of a multipart/form-data body, with
    the standard library's MIME parser (no extra dependency). 400 naming what is wrong."""
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        raise bad_request(
            "POST /v1/files takes multipart/form-data (fields purpose and file)",
            None,
            code="invalid_content_type",
        )
    message = BytesParser(policy=policy.HTTP).parsebytes(
        b"Content-Type: "
        + content_type.encode("latin-1", "replace")
        + b"\r\nMIME-Version: 1.0\r\n\r\n"
        + body
    )
    if not message.is_multipart():
        raise bad_request("the multipart body could not be parsed", None, code="invalid_multipart")
    fields: dict[str, str] = {}
    upload: tuple[str, bytes] | None = None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        payload = part.get_payload(decode=True) or b""
        if name == "file":
            upload = (str(part.get_filename() or "upload.jsonl"), payload)
        else:
            fields[name] = payload.decode("utf-8", "replace")
    return fields, upload
