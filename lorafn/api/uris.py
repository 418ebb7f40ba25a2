"""Model and adapter URIs: `file://` and `pvc://<claim>/<path>`; anything else is refused.

A URI names where bytes live, not how to fetch them: resolving a `pvc://` URI to a path is the job
of whoever mounts the claim (the operator mounts it at `/mnt/pvc/<claim>`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
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


# -- what a Kubernetes deployment lets its resources name (issue 15) ---------------------------------
REASON_FILE_NOT_ALLOWED = "FileURINotAllowed"
REASON_CLAIM_NOT_ALLOWED = "ClaimNotAllowed"
ALL_NAMESPACES = "*"


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return root == "/" or path == root or path.startswith(root + "/")


@dataclass(frozen=True)
class ClusterURIPolicy:
    """Which artifact URIs a resource may name on Kubernetes, where a worker pod mounts them for it.

    A `file://` URI becomes a hostPath volume: a tenant naming `/` or another tenant's directory would
    read the node's files. So `file://` is refused unless the administrator set `file_root` (operator
    setting `file_root`, chart value `operator.fileRoot`), and then only at or under it, judged on the path
    with its symlinks resolved where the operator can see it (`realpath`: a link under the root that
    points out of it is refused too).

    A `pvc://<claim>` URI mounts a claim of `claims_namespace` (the release namespace, where the GPU pods
    run: a pod mounts claims of its own namespace only). A LoRAFunction in that namespace may name any of
    its claims; one in another namespace only a claim the administrator listed for that namespace in
    `pvc_access` (claim -> namespaces, `*` for all; chart value `operator.pvcAccess`). A Backbone
    (cluster-scoped: an administrator's object) is not limited to listed claims. Pure apart from
    `realpath`.
    """

    file_root: str = ""
    claims_namespace: str = "lorafn-system"
    pvc_access: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def of(cls, file_root: str, claims_namespace: str, pvc_access: dict[str, list[str]]) -> ClusterURIPolicy:
        if file_root and not file_root.startswith("/"):
            raise ValueError(f"file_root {file_root!r} must be an absolute path (or empty: file:// refused)")
        access = tuple(sorted((claim, tuple(sorted(set(spaces)))) for claim, spaces in pvc_access.items()))
        return cls(file_root=file_root, claims_namespace=claims_namespace, pvc_access=access)

    def refusal(
        self, uri: str, namespace: str | None, realpath: Callable[[str], str] = lambda p: p
    ) -> tuple[str, str] | None:
        """(reason, message) when a resource of `namespace` (None: cluster-scoped) may not name `uri`;
        None when it may. An unparsable URI is left to `parse_uri`'s own refusal (None here)."""
        try:
            parsed = parse_uri(uri)
        except ValueError:
            return None
        if parsed.scheme == "file":
            if not self.file_root:
                return REASON_FILE_NOT_ALLOWED, (
                    f"{uri}: file:// URIs are not allowed on this cluster (they would mount a directory of "
                    "the node); use pvc://<claim>/<path>, or ask the administrator to set operator.fileRoot"
                )
            real = realpath(parsed.path)
            for shown, path in ((parsed.path, parsed.path), (f"{parsed.path} (really {real})", real)):
                if not _under(path, self.file_root):
                    return REASON_FILE_NOT_ALLOWED, (
                        f"{uri}: {shown} is outside {self.file_root}, the only directory file:// URIs may "
                        "name on this cluster (operator.fileRoot)"
                    )
            return None
        if namespace is None or namespace == self.claims_namespace:
            return None
        allowed = dict(self.pvc_access).get(str(parsed.claim), ())
        if namespace in allowed or ALL_NAMESPACES in allowed:
            return None
        return REASON_CLAIM_NOT_ALLOWED, (
            f"{uri}: claim {parsed.claim!r} (namespace {self.claims_namespace}) is not open to functions of "
            f"namespace {namespace!r}; the administrator lists claims per namespace in operator.pvcAccess"
        )
