"""Streaming text: token ids in, text deltas out, stop strings cut without ever being streamed.

`IncrementalDetokenizer` turns generated token ids into text deltas. It decodes only a small
window (a few tokens of context + the tokens not yet turned into text), so a step costs O(1) in
the length of the output, and it holds back a delta that ends in U+FFFD (half of a multi-byte
UTF-8 character split across byte-level tokens) until the next token completes it. The first
window starts with a few prompt tokens, so a SentencePiece token keeps its leading space as it
would in context. For byte-level tokenizers (GPT-2 style: Llama 3, Qwen2, SmolLM2) the deltas
concatenated, plus `flush()`, equal ``tokenizer.decode(output_ids)``.

`StopChecker` decides when the output ends ("stop": a stop string, a stop token or EOS;
"length": ``max_tokens``) and filters the text: it holds back any tail that could be the start of
a stop string, and cuts the text before the first stop string, so no stop text is ever streamed.

`IncrementalOutput` wires the two for one request (what the engine uses)::

    out = IncrementalOutput(tokenizer, prompt_ids, params, eos_token_id=tokenizer.eos_token_id)
    delta = out.push(token_id)      # TextDelta(text, finish_reason)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from lorafn.runtime.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs (leading-space context)


class Tokenizer(Protocol):
    """What we need of a tokenizer: `tokenizers.Tokenizer` and transformers' tokenizers both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Token ids in, text deltas out, never half a character.

    ``prefix_offset .. read_offset`` is the window of already-streamed tokens decoded again as
    context; ``read_offset ..`` are the tokens whose text is not streamed yet.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Iterable[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids)[-_PROMPT_CONTEXT_TOKENS:]
        # Drop context that decodes to a partial character (would make the diff below misalign).
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = context[1:]
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_token_ids: list[int] = []
        self.text = ""  # streamed so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the new text ("" while a character is incomplete)."""
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT_CHAR):
            # Most likely an incomplete UTF-8 character: decide at the next token (or `flush`).
            return ""
        # prefix_text is normally a prefix of new_text; the common prefix also covers tokenizers
        # whose clean-up rewrites earlier text (already streamed text cannot be taken back).
        delta = new_text[len(_common_prefix(prefix_text, new_text)) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text held back at the end of the output (a trailing incomplete character, as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(_common_prefix(prefix_text, new_text)) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


class StopChecker:
    """Finish decisions and stop-string filtering for one request's stream.

    ``push(token_id, text_delta)`` for each generated token returns ``(text, finish_reason)``:
    the text that is now safe to stream, and "stop" / "length" / None. Text that could be the start
    of a stop string is held until it cannot be; when a stop string appears, the text is cut just
    before it (the rest of the output is dropped). A stop token or EOS ends the output with
    "stop" and its own text is dropped; held text is released when the output ends without a
    stop string. ``max_tokens`` counts every generated token, the stop token included.
    """

    def __init__(
        self,
        stop: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_token_id: int | Iterable[int] | None = None,
        ignore_eos: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        self.stop = [s for s in stop if s]
        self.stop_token_ids = {int(t) for t in stop_token_ids}
        if eos_token_id is None:
            self.eos_token_ids: set[int] = set()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = {eos_token_id}
        else:
            self.eos_token_ids = {int(t) for t in eos_token_id}
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.text = ""  # streamed so far; the final text once finished
        self._held = ""  # not streamed yet: could be the start of a stop string

    def _is_stop_token(self, token_id: int) -> bool:
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in self.eos_token_ids)

    def push(self, token_id: int, text_delta: str) -> tuple[str, str | None]:
        if self.finish_reason is not None:
            raise RuntimeError(f"push after the output finished ({self.finish_reason})")
        self.num_tokens += 1
        if self._is_stop_token(int(token_id)):
            return self._end("stop", self._held)
        pending = self._held + text_delta
        cut = self._find_stop(pending)
        if cut is not None:
            return self._end("stop", pending[:cut])
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return self._end("length", pending)
        keep = self._partial_stop_suffix(pending)
        emit, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += emit
        return emit, None

    def finish(self, reason: str, text_delta: str = "") -> str:
        """End the output for a reason decided elsewhere (abort, max_model_len): release held text.

        ``text_delta``: last text still to filter (e.g. the detokenizer's `flush`). A stop string
        found in it still cuts the text (the reason stays ``reason``).
        """
        if self.finish_reason is not None:
            return ""
        pending = self._held + text_delta
        cut = self._find_stop(pending)
        return self._end(reason, pending if cut is None else pending[:cut])[0]

    def _end(self, reason: str, text: str) -> tuple[str, str]:
        self._held = ""
        self.text += text
        self.finish_reason = reason
        return text, reason

    def _find_stop(self, text: str) -> int | None:
        """Start of the stop string that completes first in ``text`` (ties: the longest), or None.

        "Completes first" (earliest end) is what a character-by-character stream would see, so the
        cut does not depend on how the text was split into tokens.
        """
        best: tuple[int, int] | None = None  # (end, start)
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        return None if best is None else best[1]

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


@dataclass
class TextDelta:
    """The text one token adds to a request (not the engine's per-request `StreamDelta`)."""

    text: str
    finish_reason: str | None = None


class IncrementalOutput:
    """Detokenizer + stop checker of one request: ``push(token_id) -> TextDelta``."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Iterable[int],
        params: SamplingParams,
        eos_token_id: int | Iterable[int] | None = None,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.checker = StopChecker(
            stop=params.stop,
            stop_token_ids=params.stop_token_ids,
            eos_token_id=eos_token_id,
            ignore_eos=params.ignore_eos,
            max_tokens=params.max_tokens,
        )
        self.token_ids: list[int] = []

    @property
    def text(self) -> str:
        return self.checker.text

    @property
    def finish_reason(self) -> str | None:
        return self.checker.finish_reason

    def push(self, token_id: int) -> TextDelta:
        token_id = int(token_id)
        self.token_ids.append(token_id)
        delta = self.detokenizer.push(token_id)
        checker = self.checker
        last = checker.max_tokens is not None and checker.num_tokens + 1 >= checker.max_tokens
        if last or checker._is_stop_token(token_id):
            delta += self.detokenizer.flush()  # last token: release a held partial character
        text, reason = self.checker.push(token_id, delta)
        return TextDelta(text, reason)

    def finish(self, reason: str) -> TextDelta:
        """End for a reason decided elsewhere ("length" at max_model_len, "abort")."""
        return TextDelta(self.checker.finish(reason, self.detokenizer.flush()), reason)
