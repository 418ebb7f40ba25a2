"""The replay's manifest builder, shared by bench/batch.py and bench/admission.py: what `lorafn apply -f`
accepts, with one TTFT SLO for every function or, for bench/admission.py, one per function."""

from __future__ import annotations

from pathlib import Path

from lorafn.local.manifests import parse_manifest
from lorafn.replay.configs import ReplayConfig
from lorafn.replay.platform import FunctionSetup, manifest


def test_per_function_slos_override_the_setups_and_the_rest_keep_it() -> None:
    functions = ["adm/f00", "adm/f01", "adm/f02"]
    keys = {fn: f"key-{i}" for i, fn in enumerate(functions)}
    config = ReplayConfig("admission", "bench/admission.py", min_replicas=1, warm_pool_fallback=(0, 0))
    setup = FunctionSetup(slo_ttft_ms=5000, keep_alive_s=3600, max_replicas=1, kv_cache_mib=64)
    text = manifest(
        Path("/m"), "float32", functions, [Path("/a/0")], keys, setup, config, True,
        namespace="adm", secret="adm-keys", slos={"adm/f00": 250, "adm/f02": 8000},
    )  # fmt: skip
    parsed = parse_manifest(text)
    slos = {f"{d.ref.namespace}/{d.ref.name}": d.spec.slo.ttft_ms for d in parsed.functions}
    assert slos == {"adm/f00": 250, "adm/f01": 5000, "adm/f02": 8000}
    assert all(d.spec.scaling.min_replicas == 1 for d in parsed.functions)
    assert parsed.secret("adm", "adm-keys") is not None
    same = manifest(Path("/m"), "float32", functions, [Path("/a/0")], keys, setup, config, True,
                    namespace="adm", secret="adm-keys")  # fmt: skip
    assert {d.spec.slo.ttft_ms for d in parse_manifest(same).functions} == {5000}
