import pytest
from pydantic import ValidationError

from lorafn.api import BackboneSpec, FunctionRef, LoRAFunctionSpec
from lorafn.api.errors import format_validation_error

MINIMAL = {"backbone": "smollm2", "adapter": {"uri": "file:///adapters/french"}}


def test_minimal_function_gets_documented_defaults() -> None:
    spec = LoRAFunctionSpec.model_validate(MINIMAL)
    assert spec.scaling.min_replicas == 0
    assert spec.scaling.max_replicas == 1
    assert spec.slo.ttft_ms == 1000
    assert spec.auth.api_key_secret_ref is None


def test_camel_case_round_trip() -> None:
    body = {
        **MINIMAL,
        "slo": {"ttftMs": 250, "tpotMs": 40},
        "scaling": {"minReplicas": 1, "maxReplicas": 4, "keepAliveSeconds": 30},
        "resources": {"kvCacheMiB": 512},
        "generation": {"maxTokens": 64, "temperature": 0.0, "topP": 0.9, "topK": 0, "stop": ["\n\n"]},
        "auth": {"apiKeySecretRef": {"name": "french-keys", "key": "api-keys"}},
    }
    spec = LoRAFunctionSpec.model_validate(body)
    assert spec.scaling.keep_alive_seconds == 30
    assert spec.to_k8s() == body


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"scaling": {"minReplicas": -1}}, "spec.scaling.minReplicas"),
        (
            {"scaling": {"minReplicas": 3, "maxReplicas": 2}},
            "minReplicas (3) must be <= scaling.maxReplicas (2)",
        ),
        ({"slo": {"ttftMs": 0}}, "spec.slo.ttftMs"),
        ({"generation": {"temperature": 3}}, "spec.generation.temperature"),
        ({"generation": {"topP": 0}}, "spec.generation.topP"),
        ({"adapter": {"uri": "s3://x/y"}}, "scheme 's3'"),
        ({"backbone": "Not_A_Name"}, "DNS-1123"),
        ({"colour": "blue"}, "spec.colour"),
    ],
)
def test_invalid_function_specs_name_the_field(patch: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        LoRAFunctionSpec.model_validate({**MINIMAL, **patch})
    assert field in format_validation_error(info.value)


def test_backbone_spec_bounds() -> None:
    spec = BackboneSpec.model_validate({"model": {"uri": "pvc://models/llama-2-7b"}})
    assert spec.dtype == "bfloat16"
    assert spec.warm_pool.min_standby <= spec.warm_pool.max_standby
    with pytest.raises(ValidationError, match="minStandby"):
        BackboneSpec.model_validate(
            {"model": {"uri": "file:///m"}, "warmPool": {"minStandby": 5, "maxStandby": 1}}
        )
    with pytest.raises(ValidationError, match="dtype"):
        BackboneSpec.model_validate({"model": {"uri": "file:///m"}, "dtype": "int3"})


def test_function_ref_parse_and_print() -> None:
    ref = FunctionRef.parse("team-a/french")
    assert (ref.namespace, ref.name, str(ref)) == ("team-a", "french", "team-a/french")
    for bad in ("french", "a/b/c", "A/b", "/x", "x/"):
        with pytest.raises(ValueError):
            FunctionRef.parse(bad)
