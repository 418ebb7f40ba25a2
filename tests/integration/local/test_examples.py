"""examples/local/ (the README's day-to-day example) applies as the README says: a real redis-server, the
real SmolLM2 backbone and the example adapter, at the paths the YAML names (moved under a tmp dir)."""

from __future__ import annotations

import shutil
from pathlib import Path

from lorafn.local.apply import apply_manifest
from lorafn.local.manifests import parse_manifest
from lorafn.store import Keys, Store
from lorafn.store.registry import ensure_salt, get_function, hash_api_key, lookup_api_key

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
ROOT = "/tmp/lorafn-example"  # where the README puts the model and the adapter


def test_the_local_examples_apply(redis_server: str, smollm2_dir: Path, tmp_path: Path) -> None:
    # The README's steps: pull the model to ROOT/smollm2-135m, copy the adapter to ROOT/french.
    shutil.copytree(smollm2_dir, tmp_path / "smollm2-135m")
    shutil.copytree(EXAMPLES / "adapters" / "french", tmp_path / "french")
    store, keys = Store(redis_server), Keys("ex")
    applied = []
    for name in ("backbone.yaml", "function.yaml"):
        text = (EXAMPLES / "local" / name).read_text()
        assert ROOT in text
        manifest = parse_manifest(text.replace(ROOT, str(tmp_path)))
        applied += apply_manifest(store, keys, manifest, api_keys=["lfn-example"])
    assert [a.line().split(" (")[0] for a in applied] == [
        "backbone/smollm2-135m created",
        "lorafunction/demo/french created",
    ]
    record = store.run(get_function(keys, "demo/french"))
    assert record is not None and record.extra["rank"] == "8"
    salt = store.run(ensure_salt(keys))
    assert store.run(lookup_api_key(keys, hash_api_key(salt, "lfn-example"))) == "demo/french"
