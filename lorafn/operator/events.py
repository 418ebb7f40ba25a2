"""The two side effects every reconcile shares: the clock of status timestamps and Kubernetes events."""

from __future__ import annotations

import datetime
from typing import Any

import kopf


def now() -> str:
    """The timestamp of a condition transition (RFC 3339, seconds)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def post(body: Any, event_type: str, reason: str, message: str) -> None:
    """Post a Kubernetes event about `body` (kopf batches and posts them; tests replace this)."""
    (kopf.info if event_type == "Normal" else kopf.warn)(body, reason=reason, message=message)
