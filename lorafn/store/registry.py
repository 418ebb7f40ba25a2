"""The function registry: registration records and API-key hashes.

A record is a Redis hash of plain strings; `spec` holds the LoRAFunction spec as JSON (the Kubernetes
form), `model_dir` the backbone's model directory (the gateway reads the tokenizer and chat template
there), `adapter_dir` the adapter directory, `max_context` the backbone's context length. API keys are
never stored: only HMAC-SHA256(per-deployment salt, key), in an index hash -> function, so one HGET
answers "which function does this key open?".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from lorafn.store.client import Op, eval_script
from lorafn.store.keys import Keys, check_function

HASH_SCHEME = "hmac-sha256"


def hash_api_key(salt: str, api_key: str) -> str:
    """`hmac-sha256:<hex>` of the key under the deployment's salt."""
    digest = hmac.new(salt.encode(), api_key.encode(), hashlib.sha256).hexdigest()
    return f"{HASH_SCHEME}:{digest}"


@dataclass(frozen=True)
class FunctionRecord:
    """What the gateway and workers need to know about a registered function."""

    function: str
    spec: dict[str, Any]
    model_dir: str = ""
    adapter_dir: str = ""
    max_context: int = 0  # 0: read it from model_dir/config.json
    public: bool = False  # True: invocable without an API key (local `--no-auth`)
    rate_limit_rps: float | None = None  # None: the gateway's default
    rate_limit_burst: int | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def to_hash(self) -> dict[str, str]:
        out = {
            "spec": json.dumps(self.spec, sort_keys=True),
            "model_dir": self.model_dir,
            "adapter_dir": self.adapter_dir,
            "max_context": str(int(self.max_context)),
            "public": "1" if self.public else "0",
        }
        if self.rate_limit_rps is not None:
            out["rate_limit_rps"] = repr(float(self.rate_limit_rps))
        if self.rate_limit_burst is not None:
            out["rate_limit_burst"] = str(int(self.rate_limit_burst))
        for k, v in self.extra.items():
            out.setdefault(f"x_{k}", str(v))
        return out

    @classmethod
    def from_hash(cls, function: str, h: dict[str, str]) -> FunctionRecord:
        return cls(
            function=function,
            spec=json.loads(h.get("spec") or "{}"),
            model_dir=h.get("model_dir", ""),
            adapter_dir=h.get("adapter_dir", ""),
            max_context=int(h.get("max_context") or 0),
            public=h.get("public") == "1",
            rate_limit_rps=float(h["rate_limit_rps"]) if h.get("rate_limit_rps") else None,
            rate_limit_burst=int(h["rate_limit_burst"]) if h.get("rate_limit_burst") else None,
            extra={k[2:]: v for k, v in h.items() if k.startswith("x_")},
        )


def ensure_salt(keys: Keys) -> Op[str]:
    """The deployment's salt, created on first use (SET NX: every process agrees on one)."""

    def build(pipe: Any) -> None:
        pipe.set(keys.salt(), secrets.token_hex(16), nx=True)
        pipe.get(keys.salt())

    return Op(build, lambda r: r[1])


def put_function(keys: Keys, record: FunctionRecord) -> Op[None]:
    """Create or replace a registration (its API keys are set separately with `set_api_keys`)."""
    fn = check_function(record.function)

    def build(pipe: Any) -> None:
        pipe.delete(keys.function(fn))
        pipe.hset(keys.function(fn), mapping=record.to_hash())
        pipe.sadd(keys.functions(), fn)

    return Op(build, lambda r: None)


def get_function(keys: Keys, function: str) -> Op[FunctionRecord | None]:
    return Op(
        lambda pipe: pipe.hgetall(keys.function(function)),
        lambda r: FunctionRecord.from_hash(function, r[0]) if r[0] else None,
    )


def list_functions(keys: Keys) -> Op[list[str]]:
    return Op(lambda pipe: pipe.smembers(keys.functions()), lambda r: sorted(r[0]))


def public_functions(keys: Keys, functions: list[str]) -> Op[list[str]]:
    """The subset of `functions` registered as public (invocable without a key)."""

    def build(pipe: Any) -> None:
        for fn in functions:
            pipe.hget(keys.function(fn), "public")

    return Op(build, lambda r: [fn for fn, p in zip(functions, r, strict=True) if p == "1"])


def delete_function(keys: Keys, function: str) -> Op[bool]:
    fn = check_function(function)
    return Op(
        lambda pipe: eval_script(
            pipe,
            "delete_function",
            [keys.functions(), keys.function(fn), keys.function_keys(fn), keys.api_keys()],
            [fn],
        ),
        lambda r: bool(r[0]),
    )


def set_api_keys(keys: Keys, function: str, key_hashes: list[str]) -> Op[int]:
    """Replace the keys that open `function` (hashes from `hash_api_key`).

    Raises redis.ResponseError containing API_KEY_TAKEN when a key already opens another function.
    """
    fn = check_function(function)
    for h in key_hashes:
        if not h.startswith(f"{HASH_SCHEME}:"):
            raise ValueError("set_api_keys takes key hashes (hash_api_key), never plaintext keys")
    return Op(
        lambda pipe: eval_script(
            pipe, "set_api_keys", [keys.api_keys(), keys.function_keys(fn)], [fn, *key_hashes]
        ),
        lambda r: int(r[0]),
    )


def lookup_api_key(keys: Keys, key_hash: str) -> Op[str | None]:
    """The function this key hash opens, or None."""
    return Op(lambda pipe: pipe.hget(keys.api_keys(), key_hash), lambda r: r[0])
