import pytest

from lorafn.api import parse_uri


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
