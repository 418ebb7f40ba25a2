import inspect

import pytest

from lorafn.store import Keys, Op, combine
from lorafn.store.client import script
from lorafn.store.registry import FunctionRecord, hash_api_key
from lorafn.store.streams import stream_entries

# A value for each parameter name the key methods take; a method with a new parameter name fails below.
KEY_ARGS = {
    "function": "team-a/summarize",
    "request_id": "r1",
    "worker_id": "w1",
    "bucket": 7,
    "name": "bb",
    "backbone": "bb",
    "gpu": "local/0",
    "gpu_model": "NVIDIA-H100-80GB-HBM3",
    "shape": "q_proj:16,v_proj:16",
    "file_id": "file-1",
    "batch_id": "batch_1",
}


def key_names(k: Keys) -> dict[str, str]:
    """Every key of the schema: each public method of Keys, called with KEY_ARGS (not a list by hand,
    which missed the keys added after it)."""
    names = {}
    for attr, method in inspect.getmembers(k, inspect.ismethod):
        if attr.startswith("_"):
            continue
        params = inspect.signature(method).parameters
        missing = set(params) - set(KEY_ARGS)
        assert not missing, f"Keys.{attr} takes {missing}: add a value to KEY_ARGS"
        names[attr] = method(**{p: KEY_ARGS[p] for p in params})
    return names


def test_every_key_is_under_the_prefix_and_distinct() -> None:
    k = Keys("dep1")
    names = key_names(k)
    # the schema's core keys are all seen (guards against the introspection finding nothing)
    assert {"requests", "reply", "cancel", "worker", "control", "stats", "backbone", "backbones"} <= set(
        names
    )
    assert all(n.startswith("dep1:") for n in names.values()), names
    assert len(set(names.values())) == len(names), names
    other = key_names(Keys("dep2"))
    assert all(other[attr] != names[attr] for attr in names)


@pytest.mark.parametrize("bad", ["nofunction", "a/b/c", "a b/c", "a:b/c", "", "a/{x}"])
def test_function_names_that_would_break_the_schema_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="namespace/name"):
        Keys().requests(bad)


@pytest.mark.parametrize("bad", ["", "has space", "a:b", "x" * 200])
def test_ids_are_checked(bad: str) -> None:
    with pytest.raises(ValueError):
        Keys().reply(bad)
    with pytest.raises(ValueError):
        Keys().worker(bad)


def test_prefix_is_checked() -> None:
    with pytest.raises(ValueError, match="prefix"):
        Keys("bad prefix")


def test_api_keys_are_hashed_with_the_salt_never_stored_plain() -> None:
    h = hash_api_key("salt1", "sk-secret")
    assert h.startswith("hmac-sha256:") and "sk-secret" not in h
    assert h == hash_api_key("salt1", "sk-secret")
    assert h != hash_api_key("salt2", "sk-secret")


def test_function_record_round_trips_through_a_hash() -> None:
    rec = FunctionRecord(
        "a/b",
        {"backbone": "x"},
        model_dir="/m",
        adapter_dir="/a",
        max_context=4096,
        public=True,
        rate_limit_rps=2.5,
        rate_limit_burst=5,
        extra={"owner": "me"},
    )
    h = rec.to_hash()
    assert all(isinstance(v, str) for v in h.values())
    assert FunctionRecord.from_hash("a/b", h) == rec


def test_lua_scripts_are_package_resources() -> None:
    for name in ("admit", "demand", "heartbeat", "count_live", "set_api_keys", "delete_function"):
        assert "redis.call" in script(name)


class _Pipe:
    def __init__(self) -> None:
        self.command_stack: list[tuple] = []

    def get(self, key: str) -> None:
        self.command_stack.append(("GET", key))


def test_combine_splits_replies_per_operation() -> None:
    one = Op(lambda p: p.get("a"), lambda r: r)
    two = Op(lambda p: (p.get("b"), p.get("c")), lambda r: r)
    op = combine(one, two, one.map(len))
    pipe = _Pipe()
    op.build(pipe)
    assert len(pipe.command_stack) == 4
    assert op.parse(["A", "B", "C", "D"]) == (["A"], ["B", "C"], 1)


def test_stream_entries_reads_resp2_and_resp3_shapes() -> None:
    resp2 = [["s", [("1-0", {"a": "1"}), ("2-0", {"b": "2"})]]]
    resp3 = {"s": [[("1-0", {"a": "1"}), ("2-0", {"b": "2"})]]}
    expected = [("1-0", {"a": "1"}), ("2-0", {"b": "2"})]
    assert stream_entries(resp2) == expected
    assert stream_entries(resp3) == expected
    assert stream_entries(None) == []
