import pytest

from lorafn.api import parse_uri
from lorafn.api.uris import REASON_CLAIM_NOT_ALLOWED, REASON_FILE_NOT_ALLOWED, ClusterURIPolicy


def test_file_uri_resolves_to_its_path() -> None:
    uri = parse_uri("file:///models/smollm2")
    assert uri.scheme == "file"
    assert uri.local_path() == "/models/smollm2"
    assert str(uri) == "file:///models/smollm2"


def test_pvc_uri_resolves_under_the_claim_mount() -> None:
    uri = parse_uri("pvc://adapters/team-a/french")
    assert (uri.scheme, uri.claim, uri.path) == ("pvc", "adapters", "team-a/french")
    assert uri.local_path() == "/mnt/pvc/adapters/team-a/french"
    assert uri.local_path("/data") == "/data/adapters/team-a/french"
    assert str(uri) == "pvc://adapters/team-a/french"


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://bucket/model", "scheme 's3'"),
        ("hf://meta/llama", "scheme 'hf'"),
        ("/models/x", "no scheme"),
        ("file://relative/path", "absolute path"),
        ("file:///a/../etc", "'..'"),
        ("pvc://Bad_Claim/x", "not a valid PersistentVolumeClaim name"),
        ("pvc://claim/../x", "'..'"),
        ("", "non-empty"),
    ],
)
def test_bad_uris_are_refused_with_the_reason(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_uri(uri)


# -- ClusterURIPolicy (issue 15): what a resource may name on Kubernetes ------------------------------


def _policy(file_root: str = "", access: dict[str, list[str]] | None = None) -> ClusterURIPolicy:
    return ClusterURIPolicy.of(file_root, "lorafn-system", access or {})


def test_file_uris_are_refused_unless_the_administrator_set_a_root() -> None:
    refused = _policy().refusal("file:///models/llama", "team-a")
    assert refused is not None and refused[0] == REASON_FILE_NOT_ALLOWED and "operator.fileRoot" in refused[1]
    assert _policy().refusal("file:///models/llama", None) is not None  # a Backbone too


def test_file_uris_only_under_the_root_also_after_symlinks() -> None:
    policy = _policy("/srv/lorafn")
    assert policy.refusal("file:///srv/lorafn/adapters/fr", "team-a") is None
    assert policy.refusal("file:///srv/lorafn", "team-a") is None
    assert policy.refusal("file:///srv/lorafn-other/fr", "team-a") is not None  # a prefix, not the root
    assert policy.refusal("file:///etc", "team-a") is not None
    # a link under the root that points out of it
    out = policy.refusal("file:///srv/lorafn/fr", "team-a", realpath=lambda p: "/etc/secrets")
    assert out is not None and "really /etc/secrets" in out[1]


def test_pvc_claims_only_in_the_release_namespace_or_listed_for_the_namespace() -> None:
    policy = _policy(access={"shared": ["*"], "team-a-adapters": ["team-a"]})
    assert policy.refusal("pvc://team-a-adapters/fr", "team-a") is None
    refused = policy.refusal("pvc://team-a-adapters/fr", "team-b")
    assert refused is not None and refused[0] == REASON_CLAIM_NOT_ALLOWED and "team-b" in refused[1]
    assert policy.refusal("pvc://shared/base", "team-b") is None
    assert policy.refusal("pvc://unlisted/x", "team-a") is not None
    assert policy.refusal("pvc://unlisted/x", "lorafn-system") is None  # the claims' own namespace
    assert policy.refusal("pvc://unlisted/x", None) is None  # a Backbone: an administrator's object


def test_a_relative_file_root_is_refused() -> None:
    with pytest.raises(ValueError, match="file_root"):
        ClusterURIPolicy.of("srv", "lorafn-system", {})
