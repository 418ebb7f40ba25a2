"""Model and adapter URIs: `file://` and `pvc://<claim>/<path>`; anything else is refused.

A URI names where bytes live, not how to fetch them: resolving a `pvc://` URI to a path is the job
of whoever mounts the claim (the operator mounts it at `/mnt/pvc/<claim>`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

SUPPORTED_SCHEMES = ("file", "pvc")
PVC_MOUNT_ROOT = "/mnt/pvc"

# A PersistentVolumeClaim name is a DNS-1123 subdomain.
_CLAIM_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class ArtifactURI:
    """A parsed model or adapter location."""

    scheme: Literal["file", "pvc"]
    path: str
    claim: str | None = None

    def local_path(self, pvc_root: str = PVC_MOUNT_ROOT) -> str:
        """The filesystem path where the artifact is visible inside a pod or on this machine."""
        if self.scheme == "file":
            return self.path
        return str(PurePosixPath(pvc_root) / str(self.claim) / self.path.lstrip("/"))

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        return f"pvc://{self.claim}/{self.path.lstrip('/')}"


def parse_uri(uri: str) -> ArtifactURI:
    """Parse `file:///abs/path` or `pvc://claim/path`; raise ValueError naming the problem otherwise."""
    if not isinstance(uri, str) or not uri:
        raise ValueError("uri must be a non-empty string")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise ValueError(f"uri {uri!r} has no scheme; use file:///path or pvc://<claim>/<path>")
    if scheme not in SUPPORTED_SCHEMES:
        raise ValueError(
            f"uri scheme {scheme!r} in {uri!r} is not supported; supported: "
            + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        )
    if scheme == "file":
        if not rest.startswith("/"):
            raise ValueError(f"file uri {uri!r} must hold an absolute path (file:///abs/path)")
        if ".." in PurePosixPath(rest).parts:
            raise ValueError(f"file uri {uri!r} must not contain '..'")
        return ArtifactURI(scheme="file", path=rest)
    claim, _, path = rest.partition("/")
    if not _CLAIM_RE.match(claim):
        raise ValueError(f"pvc uri {uri!r}: {claim!r} is not a valid PersistentVolumeClaim name")
    if ".." in PurePosixPath(path).parts:
        raise ValueError(f"pvc uri {uri!r} must not contain '..'")
    return ArtifactURI(scheme="pvc", path=path, claim=claim)
