"""The backbone's tokenizer and chat template in the gateway, without torch or transformers.

`tokenizer.json` is read with the `tokenizers` library; the chat template comes from
`chat_template.jinja` or `tokenizer_config.json` and is rendered with a sandboxed jinja2 environment
configured as transformers configures it (trim_blocks, lstrip_blocks, `raise_exception`, `tojson`).
The gateway counts prompt tokens with it (limits) and sends the token ids to the worker, so the
worker does not tokenize again.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from lorafn.api.tokenizer import read_tokenizer, token_text

# When the model ships no chat template: ChatML, the most common format of instruct models.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Placeholders for special-token text found in chat messages (Supplementary Private Use Area-B, which
# real text does not use; such characters in a message are escaped the same way, so none is mistaken).
_PUA_FIRST, _PUA_LAST = 0x100000, 0x10FFFD
_PLACEHOLDER = re.compile(f"[{chr(_PUA_FIRST)}-{chr(_PUA_LAST)}]")


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's template (e.g. roles it refuses)."""


class GatewayTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.tokenizer, config = read_tokenizer(model_dir, who="gateway")
        template = config.get("chat_template")
        if (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.has_chat_template = bool(template)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template or DEFAULT_CHAT_TEMPLATE)
        self.special = {
            "bos_token": token_text(config.get("bos_token")),
            "eos_token": token_text(config.get("eos_token")),
            "pad_token": token_text(config.get("pad_token")),
            "unk_token": token_text(config.get("unk_token")),
        }
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # A message's own text is tokenized without special tokens: `<|im_start|>system` typed by a
        # user must stay text, not become a role marker (role injection). `_plain` is a second
        # instance with special-token matching off (a shared flag would race between threads).
        specials = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        self._plain = Tokenizer.from_str(self.tokenizer.to_str())
        self._plain.encode_special_tokens = True
        alternatives = [re.escape(t) for t in sorted(specials, key=len, reverse=True) if t]
        self._escape = re.compile("|".join([*alternatives, _PLACEHOLDER.pattern]))
        self.max_context = 0
        if (model_dir / "config.json").is_file():
            model_config = json.loads((model_dir / "config.json").read_text())
            self.max_context = int(model_config.get("max_position_embeddings") or 0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only it releases the GIL while it works, so the gateway's event
        # loop keeps running while a thread tokenizes a large prompt
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template refused the messages: {e}") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        """The rendered prompt and its ids. The template writes the special tokens itself (as in
        transformers' apply_chat_template), so none are added on encoding.

        Special-token text inside a message (content, name) is encoded as plain text: it is swapped
        for a placeholder before rendering, and each placeholder is encoded with `_plain`. Messages
        without such text are encoded in one piece, exactly as transformers does.
        """
        originals: list[str] = []

        def hide(match: re.Match[str]) -> str:
            if len(originals) > _PUA_LAST - _PUA_FIRST:
                raise ChatTemplateError("messages: too many special-token strings in the messages")
            originals.append(match.group(0))
            return chr(_PUA_FIRST + len(originals) - 1)

        escaped = [
            {k: self._escape.sub(hide, v) if k in ("content", "name") else v for k, v in m.items()}
            for m in messages
        ]
        rendered = self.render_chat(escaped)
        if not originals:
            return rendered, self.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        pieces = _PLACEHOLDER.split(rendered)
        found = _PLACEHOLDER.findall(rendered)
        for i, piece in enumerate(pieces):
            if piece:
                ids += self.encode(piece, add_special_tokens=False)
            if i < len(found):
                plain = originals[ord(found[i]) - _PUA_FIRST]
                ids += self._plain.encode_batch([plain], add_special_tokens=False)[0].ids
        text = _PLACEHOLDER.sub(lambda m: originals[ord(m.group(0)) - _PUA_FIRST], rendered)
        return text, ids


@lru_cache(maxsize=32)
def load_tokenizer(model_dir: str) -> GatewayTokenizer:
    """One tokenizer per model directory per process."""
    return GatewayTokenizer(model_dir)
