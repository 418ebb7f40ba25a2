"""The backbone registry: which base models exist and where their model directory is."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lorafn.store.client import Op
from lorafn.store.keys import Keys, check_id


@dataclass(frozen=True)
class BackboneRecord:
    name: str
    model_dir: str
    dtype: str
    spec: dict[str, Any]

    def to_hash(self) -> dict[str, str]:
        return {
            "model_dir": self.model_dir,
            "dtype": self.dtype,
            "spec": json.dumps(self.spec, sort_keys=True),
        }

    @classmethod
    def from_hash(cls, name: str, h: dict[str, str]) -> BackboneRecord:
        return cls(
            name=name,
            model_dir=h.get("model_dir", ""),
            dtype=h.get("dtype", ""),
            spec=json.loads(h.get("spec") or "{}"),
        )


def put_backbone(keys: Keys, record: BackboneRecord) -> Op[None]:
    name = check_id(record.name, "backbone name")

    def build(pipe: Any) -> None:
        pipe.delete(keys.backbone(name))
        pipe.hset(keys.backbone(name), mapping=record.to_hash())
        pipe.sadd(keys.backbones(), name)

    return Op(build, lambda r: None)


def get_backbone(keys: Keys, name: str) -> Op[BackboneRecord | None]:
    return Op(
        lambda pipe: pipe.hgetall(keys.backbone(name)),
        lambda r: BackboneRecord.from_hash(name, r[0]) if r[0] else None,
    )


def list_backbones(keys: Keys) -> Op[list[str]]:
    return Op(lambda pipe: pipe.smembers(keys.backbones()), lambda r: sorted(r[0]))


def delete_backbone(keys: Keys, name: str) -> Op[None]:
    def build(pipe: Any) -> None:
        pipe.delete(keys.backbone(name))
        pipe.srem(keys.backbones(), name)

    return Op(build, lambda r: None)
