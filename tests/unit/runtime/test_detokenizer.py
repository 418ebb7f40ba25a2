"""Streaming detokenization and stop handling, with a real byte-level BPE built with `tokenizers`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lorafn.runtime.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    IncrementalOutput,
    StopChecker,
    TextDelta,
)
from lorafn.runtime.sampling_params import SamplingParams

CORPUS = [
    "Hello world, café au lait. Le garçon a mangé une crème brûlée.",
    "日本語のテキストです。東京は日本の首都です。",
    "The quick brown fox jumps over the lazy dog. ### END ###",
    "Emoji: 🙂 🎉 👍🏽 — and math: ∑ x² ≤ ∞.",
    "def f(x):\n    return x + 1\n\n# comment\n",
] * 10

ALPHABET = "ab é日本🙂🎉#\n.xyzçü∞—"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def stream(tok, ids, prompt="Q: ", skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, tok.encode(prompt).ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.output_token_ids == list(ids)
    return deltas


def test_tokenizer_really_splits_multibyte_characters(tok):
    # The property tests below mean something only if characters are split across tokens.
    ids = tok.encode("👍🏽∞").ids
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)


@pytest.mark.parametrize(
    "text",
    ["café", "日本", "🙂🎉", "a é 日本 🙂 b", "👍🏽∞ ü—ç", "Hello world, café!\n日本語 🎉🎉", "x"],
)
def test_deltas_concatenate_to_decode_and_never_split_a_character(tok, text):
    ids = tok.encode(text).ids
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert deltas[-1] == ""  # nothing left to flush for valid text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=ALPHABET, min_size=1, max_size=40), st.text(alphabet=ALPHABET, max_size=10))
def test_streaming_any_text_gives_exact_decode(text, prompt):
    tokenizer = _module_tok()
    ids = tokenizer.encode(text).ids
    deltas = stream(tokenizer, ids, prompt=prompt)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 399), min_size=1, max_size=30), st.booleans())
def test_streaming_arbitrary_token_ids_matches_decode(ids, skip_special):
    # Random ids can form invalid UTF-8 and special tokens: deltas + flush still equal decode().
    tokenizer = _module_tok()
    deltas = stream(tokenizer, ids, skip_special_tokens=skip_special)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special)


def test_special_tokens_are_skipped(tok):
    eos = tok.token_to_id("<eos>")
    ids = [*tok.encode("ab").ids, eos, *tok.encode("日").ids]
    assert "".join(stream(tok, ids)) == "ab日"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == "ab<eos>日"


_TOK = None


def _module_tok() -> Tokenizer:
    """The fixture's tokenizer for hypothesis tests (fixtures do not mix with @given)."""
    global _TOK
    if _TOK is None:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<eos>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(CORPUS, trainer)
        _TOK = tokenizer
    return _TOK


# ---------------------------------------------------------------------------- stop handling


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Character by character: cut before the first stop string to complete (ties: the longest)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def run_output(tok, ids, params: SamplingParams, eos=None):
    out = IncrementalOutput(tok, tok.encode("prompt: ").ids, params, eos_token_id=eos)
    deltas, reason = [], None
    for i in ids:
        d = out.push(i)
        assert isinstance(d, TextDelta)
        deltas.append(d.text)
        if d.finish_reason:
            reason = d.finish_reason
            break
    return deltas, reason, out


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=ALPHABET, min_size=1, max_size=40),
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), min_size=1, max_size=3),
    st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=2),
)
def test_stop_strings_are_cut_and_never_streamed(text, spans, extra_stops):
    tokenizer = _module_tok()
    # Stop strings taken from the text itself (so they often span token boundaries) + random ones.
    stops = [text[a : a + n] for a, n in spans if text[a : a + n]] + extra_stops
    ids = tokenizer.encode(text).ids
    params = SamplingParams(max_tokens=len(ids), stop=stops)
    deltas, reason, out = run_output(tokenizer, ids, params)
    expected, found = reference_cut(text, stops)
    assert "".join(deltas) == out.text == expected
    assert reason == ("stop" if found else "length")
    streamed = ""
    for d in deltas:  # every moment of the stream is a prefix of the final, cut text
        streamed += d
        assert expected.startswith(streamed)


def test_stop_string_spanning_tokens_example(tok):
    text = "Hello world. ### END ###"
    ids = tok.encode(text).ids
    assert len(ids) > 4
    deltas, reason, out = run_output(tok, ids, SamplingParams(max_tokens=100, stop=["# END"]))
    assert reason == "stop" and out.text == "Hello world. ##"
    assert not any("END" in d for d in deltas)


def test_partial_stop_prefix_is_held_then_released(tok):
    checker = StopChecker(stop=["###"], max_tokens=10)
    assert checker.push(1, "a#") == ("a", None)
    assert checker.push(2, "#") == ("", None)  # "##" could start "###"
    assert checker.push(3, "b") == ("##b", None)
    assert checker.push(4, "c##") == ("c", None)
    assert checker.finish("abort") == "##"  # released when the output ends another way
    assert checker.text == "a##bc##"


def test_first_completed_stop_string_wins():
    checker = StopChecker(stop=["cd", "b"], max_tokens=10)
    assert checker.push(1, "abcd") == ("a", "stop")
    # "a.a" starts first but "." completes first: the cut is the same however the text is split.
    for pieces in (["a.a"], ["a", ".a"], ["a", ".", "a"]):
        checker = StopChecker(stop=["a.a", "."], max_tokens=10)
        text = ""
        for i, piece in enumerate(pieces):
            emitted, reason = checker.push(i, piece)
            text += emitted
            if reason:
                break
        assert (text, reason) == ("a", "stop")


def test_stop_token_and_eos(tok):
    eos = tok.token_to_id("<eos>")
    body = tok.encode("café 日本").ids
    _, reason, out = run_output(tok, [*body, eos, *body], SamplingParams(max_tokens=50), eos=eos)
    assert reason == "stop" and out.text == "café 日本" and out.token_ids == [*body, eos]
    # ignore_eos: EOS is just a (skipped special) token; max_tokens ends the output.
    _, reason, out = run_output(
        tok, [*body, eos, *body], SamplingParams(max_tokens=2 * len(body) + 1, ignore_eos=True), eos=eos
    )
    assert reason == "length" and out.text == "café 日本café 日本"
    # A stop token id that has text: its text is not part of the output.
    x = tok.encode("x").ids[0]
    _, reason, out = run_output(tok, [*body, x, *body], SamplingParams(max_tokens=50, stop_token_ids=[x]))
    assert reason == "stop" and out.text == "café 日本"
    # EOS given as a list (Llama 3 has several).
    checker = StopChecker(eos_token_id=[7, 9], max_tokens=5)
    assert checker.push(9, "") == ("", "stop")


def test_max_tokens_releases_held_text_and_partial_characters(tok):
    ids = tok.encode("a ##").ids
    deltas, reason, out = run_output(tok, ids, SamplingParams(max_tokens=len(ids), stop=["###"]))
    assert reason == "length" and out.text == "a ##" and "".join(deltas) == "a ##"
    # Output cut in the middle of a multi-byte character: the partial character comes out as U+FFFD.
    ids = tok.encode("a👍🏽").ids
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(REPLACEMENT_CHAR))
    deltas, reason, out = run_output(tok, ids[:cut], SamplingParams(max_tokens=cut))
    assert reason == "length" and out.text == tok.decode(ids[:cut])


def test_max_tokens_counts_every_token():
    checker = StopChecker(max_tokens=3)
    assert checker.push(1, "a") == ("a", None)
    assert checker.push(2, "b") == ("b", None)
    assert checker.push(3, "c") == ("c", "length")
    with pytest.raises(RuntimeError):
        checker.push(4, "d")
