import pytest

from lorafn.local.manifests import ManifestError, parse_manifest

GOOD = """
apiVersion: lorafn.io/v1alpha1
kind: Backbone
metadata: {name: smollm2}
spec:
  model: {uri: "file:///models/smollm2"}
  dtype: float32
---
apiVersion: v1
kind: Secret
metadata: {name: french-keys, namespace: demo}
stringData: {api-keys: "key-one"}
data: {other: "a2V5LXR3bw=="}
---
apiVersion: lorafn.io/v1alpha1
kind: LoRAFunction
metadata: {name: french, namespace: demo}
spec:
  backbone: smollm2
  adapter: {uri: "file:///adapters/french"}
  auth: {apiKeySecretRef: {name: french-keys}}
"""


def test_a_file_with_all_three_kinds() -> None:
    manifest = parse_manifest(GOOD)
    assert [b.name for b in manifest.backbones] == ["smollm2"]
    assert manifest.backbones[0].spec.dtype == "float32"
    (function,) = manifest.functions
    assert str(function.ref) == "demo/french"
    secret = manifest.secret("demo", "french-keys")
    assert secret is not None
    assert secret.data == {"api-keys": "key-one", "other": "key-two"}
    assert manifest.secret("other", "french-keys") is None


def test_namespace_defaults_to_default() -> None:
    manifest = parse_manifest(GOOD.split("---")[2].replace("namespace: demo", ""))
    assert str(manifest.functions[0].ref) == "default/french"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [", "not valid YAML"),
        ("- 1\n- 2", "expected a mapping"),
        ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}", "kind 'ConfigMap' is not supported"),
        ("apiVersion: lorafn.io/v1\nkind: LoRAFunction\nmetadata: {name: x}\nspec: {}", "apiVersion must be"),
        ("apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {name: x}", "spec is required"),
        ("apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nspec: {}", "metadata.name is required"),
        (
            "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {name: x}\n"
            "spec: {backbone: b, adapter: {uri: 'file:///a'}, scaling: {maxReplicas: 0}}",
            "spec.scaling.maxReplicas",
        ),
        (
            "apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {name: b, namespace: n}\n"
            "spec: {model: {uri: 'file:///m'}}",
            "cluster-scoped",
        ),
        ("apiVersion: v1\nkind: Secret\nmetadata: {name: s}\ndata: {k: '***'}", "not valid base64"),
        (
            "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {name: Bad_Name}\nspec: {}",
            "DNS-1123",
        ),
    ],
)
def test_bad_documents_are_refused_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_manifest(text)


def test_documents_are_numbered_from_one() -> None:
    bad_fourth = GOOD + "---\napiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {name: x}\n"
    with pytest.raises(ManifestError, match=r"^document 4 \(Backbone/x\): spec is required"):
        parse_manifest(bad_fourth)
    with pytest.raises(ManifestError, match=r"^document 1: expected a mapping"):
        parse_manifest("- a list\n")
