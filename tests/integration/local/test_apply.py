"""`lorafn apply` logic against a real redis-server, a real tiny model and real PEFT adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafn.local.apply import apply_manifest
from lorafn.local.manifests import ManifestError, parse_manifest
from lorafn.store import Keys, Store
from lorafn.store.backbones import get_backbone
from lorafn.store.registry import ensure_salt, get_function, hash_api_key, lookup_api_key
from tests.integration.runtime.engine_helpers import write_peft_adapter


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_peft_adapter(
        tiny_model_dir,
        tmp_path_factory.mktemp("adapters") / "a",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
    )


def _yaml(model_dir: Path, adapter: Path, secret: bool = True, backbone: bool = True) -> str:
    docs = []
    if backbone:
        docs.append(
            f"apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {{name: tiny}}\n"
            f"spec: {{model: {{uri: 'file://{model_dir}'}}, dtype: float32}}"
        )
    if secret:
        docs.append(
            "apiVersion: v1\nkind: Secret\nmetadata: {name: keys, namespace: team}\n"
            'stringData: {api-keys: "k-one\\nk-two\\n# comment"}'
        )
    docs.append(
        "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {name: fn, namespace: team}\n"
        f"spec: {{backbone: tiny, adapter: {{uri: 'file://{adapter}'}}, "
        "auth: {apiKeySecretRef: {name: keys}}}"
    )
    return "\n---\n".join(docs)


def test_apply_registers_backbone_function_and_key_hashes(
    redis_server: str, tiny_model_dir: Path, adapter_dir: Path
) -> None:
    store, keys = Store(redis_server), Keys("t")
    applied = apply_manifest(store, keys, parse_manifest(_yaml(tiny_model_dir, adapter_dir)))
    assert [(a.kind, a.name) for a in applied] == [("Backbone", "tiny"), ("LoRAFunction", "team/fn")]
    assert "rank 4" in applied[1].detail
    backbone = store.run(get_backbone(keys, "tiny"))
    assert backbone is not None and backbone.model_dir == str(tiny_model_dir)
    record = store.run(get_function(keys, "team/fn"))
    assert record is not None
    assert record.adapter_dir == str(adapter_dir)
    assert (
        record.max_context
        == json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    )
    assert not record.public
    salt = store.run(ensure_salt(keys))
    for key in ("k-one", "k-two"):
        assert store.run(lookup_api_key(keys, hash_api_key(salt, key))) == "team/fn"
    assert store.run(lookup_api_key(keys, hash_api_key(salt, "# comment"))) is None
    # No plaintext key anywhere in Redis.
    for key in store.client.scan_iter("t:*"):
        dump = store.client.dump(key) or b""
        assert b"k-one" not in dump


def test_a_bad_document_changes_nothing(redis_server: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    store, keys = Store(redis_server), Keys("t")
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(ManifestError, match="does not exist"):
        apply_manifest(store, keys, parse_manifest(_yaml(tiny_model_dir, missing)))
    assert store.run(get_backbone(keys, "tiny")) is None  # the valid Backbone was not written either


def test_function_needs_a_registered_backbone(
    redis_server: str, tiny_model_dir: Path, adapter_dir: Path
) -> None:
    with pytest.raises(ManifestError, match="'tiny' is not registered; apply the Backbone first"):
        apply_manifest(
            Store(redis_server), Keys("t"), parse_manifest(_yaml(tiny_model_dir, adapter_dir, backbone=False))
        )


def test_keys_are_required_unless_no_auth(redis_server: str, tiny_model_dir: Path, adapter_dir: Path) -> None:
    store, keys = Store(redis_server), Keys("t")
    text = _yaml(tiny_model_dir, adapter_dir, secret=False)
    with pytest.raises(ManifestError, match="Secret team/keys, which is neither in this file"):
        apply_manifest(store, keys, parse_manifest(text))
    no_ref = text.replace(", auth: {apiKeySecretRef: {name: keys}}", "")
    with pytest.raises(ManifestError, match="no API keys"):
        apply_manifest(store, keys, parse_manifest(no_ref))
    apply_manifest(store, keys, parse_manifest(no_ref), no_auth=True)
    record = store.run(get_function(keys, "team/fn"))
    assert record is not None and record.public
    apply_manifest(store, keys, parse_manifest(no_ref), api_keys=["cli-key"])
    salt = store.run(ensure_salt(keys))
    assert store.run(lookup_api_key(keys, hash_api_key(salt, "cli-key"))) == "team/fn"


def test_unsupported_adapter_is_refused_with_the_reason(
    redis_server: str, tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ManifestError, match=r"UnsupportedAdapterFeature.*use_dora"):
        apply_manifest(Store(redis_server), Keys("t"), parse_manifest(_yaml(tiny_model_dir, dora)))


def test_pvc_uris_do_not_resolve_locally(redis_server: str, tiny_model_dir: Path, adapter_dir: Path) -> None:
    text = _yaml(tiny_model_dir, adapter_dir).replace(f"file://{adapter_dir}", "pvc://claim/adapter")
    with pytest.raises(ManifestError, match="locally only file:// URIs resolve"):
        apply_manifest(Store(redis_server), Keys("t"), parse_manifest(text))


def test_an_api_key_opens_one_function_and_a_refused_file_writes_nothing(
    redis_server: str, tiny_model_dir: Path, adapter_dir: Path
) -> None:
    store, keys = Store(redis_server), Keys("t")
    text = _yaml(tiny_model_dir, adapter_dir, secret=False).replace(
        ", auth: {apiKeySecretRef: {name: keys}}", ""
    )
    apply_manifest(store, keys, parse_manifest(text), api_keys=["shared"])
    other = text.replace("name: fn,", "name: other,").split("---\n", 1)[1]
    with pytest.raises(ManifestError, match="already opens function team/fn"):
        apply_manifest(store, keys, parse_manifest(other), api_keys=["shared"])
    assert store.run(get_function(keys, "team/other")) is None
    two = text + "\n---\n" + other
    with pytest.raises(ManifestError, match="also given to team/fn in this apply"):
        apply_manifest(store, keys, parse_manifest(two), api_keys=["new-key"])
    assert store.run(get_function(keys, "team/other")) is None


def test_a_function_reaching_anothers_adapter_through_a_symlink_is_warned_about(
    redis_server: str,
    tiny_model_dir: Path,
    adapter_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 15: real paths decide (a symlink or `..` does not hide it); locally a warning at apply and in
    `lorafn status`/`get` (AdapterReady's message, `warnings`), not a refusal: one user owns them all."""
    from lorafn.local.status import collect, function_rows

    store, keys = Store(redis_server), Keys("sym")
    apply_manifest(store, keys, parse_manifest(_yaml(tiny_model_dir, adapter_dir)))
    link = tmp_path / "innocent"
    link.symlink_to(adapter_dir)
    other = (
        _yaml(tiny_model_dir, link, backbone=False)
        .replace("name: fn,", "name: other,")
        .replace("k-one\\nk-two", "k-three")
    )
    with caplog.at_level("WARNING", logger="lorafn.apply"):
        apply_manifest(store, keys, parse_manifest(other))
    warned = [r.getMessage() for r in caplog.records if "team/other" in r.getMessage()]
    assert warned and f"really {adapter_dir}" in warned[0] and "team/fn" in warned[0], caplog.text
    rows = {row["name"]: row for row in function_rows(collect(store, keys))}
    assert rows["team/other"]["warnings"] and "team/fn" in rows["team/other"]["warnings"][0]
    assert rows["team/fn"]["warnings"] and "team/other" in rows["team/fn"]["warnings"][0]
    adapter_ready = next(c for c in rows["team/other"]["conditions"] if c["type"] == "AdapterReady")
    assert "team/fn" in adapter_ready["message"]


def test_functions_with_their_own_adapters_get_no_warning(
    redis_server: str, tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    from lorafn.local.status import collect, function_rows

    store, keys = Store(redis_server), Keys("own")
    apply_manifest(store, keys, parse_manifest(_yaml(tiny_model_dir, adapter_dir)))
    assert all(not row["warnings"] for row in function_rows(collect(store, keys)))


def test_status_shows_how_long_the_oldest_queued_request_has_waited(
    redis_server: str, tiny_model_dir: Path, adapter_dir: Path
) -> None:
    """`lorafn status` / `get`: a request no worker has read yet is queued with its wait (Redis's clock, read
    by `control.queue_depths` as the controller reads it); nothing queued, no wait."""
    import io
    import time

    from rich.console import Console

    from lorafn.local.status import collect, function_rows, render_status
    from lorafn.store import streams
    from lorafn.store.protocol import RequestBody

    store, keys = Store(redis_server), Keys("wait")
    apply_manifest(store, keys, parse_manifest(_yaml(tiny_model_dir, adapter_dir)))
    (row,) = function_rows(collect(store, keys))
    assert row["queued"] == 0 and row["oldestWaitMs"] is None
    store.run(
        streams.admit(
            keys, "team/fn", "r1", RequestBody(prompt="hi"), deadline_ms=0, now_s=time.time(),
            rate_limit_rps=0.0, rate_limit_burst=1, heartbeat_ttl_ms=5000,
        )
    )  # fmt: skip
    time.sleep(0.3)
    status = collect(store, keys)
    (row,) = function_rows(status)
    assert row["queued"] == 1 and row["oldestWaitMs"] >= 300
    out = io.StringIO()
    render_status(status, Console(file=out, width=300))
    assert "1 (oldest 0." in out.getvalue() or "1 (oldest 1." in out.getvalue(), out.getvalue()
