"""Request and response bodies of the HTTP API (OpenAI-compatible + native).

Limits that do not depend on the function (ranges, n=1, list sizes) live here; limits that do (prompt
tokens against the backbone's context, max_tokens against what is left) are checked in
`admission.prepare` once the function is known. Unknown fields are ignored, as OpenAI clients send
fields this server does not use; fields whose non-default values it cannot honour (n > 1, logprobs,
echo, best_of, suffix, tools, penalties) are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP = 16
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _encodable(value: str) -> str:
    """JSON may carry a lone surrogate (`"\\ud800"`), which is no Unicode text: the tokenizer and Redis
    would fail on it with a 500. Refused here, as invalid input."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text (a lone surrogate at position {e.start})") from None
    return value


# Text the gateway tokenizes or forwards: valid Unicode only.
Text = Annotated[str, AfterValidator(_encodable)]
StopStr = Annotated[Text, Field(min_length=1, max_length=256)]
# Types are strict (no `true` for a number, no `"yes"` for a boolean, no `"5"` for an integer): a client
# that sends the wrong type has a bug it should hear about, not a guess.
TokenId = Annotated[int, Field(ge=0, lt=2**31, strict=True)]
StrictInt = Annotated[int, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class SamplingRequest(_Body):
    max_tokens: StrictInt | None = Field(
        default=None, ge=1, description="tokens to generate (default: the function's)"
    )
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False, strict=True)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False, strict=True)
    top_k: StrictInt | None = Field(
        default=None, ge=0, le=100_000, description="lorafn extension; 0 disables"
    )
    stop: StopStr | list[StopStr] | None = Field(default=None, description=f"up to {MAX_STOP} stop strings")
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(default=None, description="only 1 is supported")
    presence_penalty: float | None = Field(default=None, description="only 0 is supported", strict=True)
    frequency_penalty: float | None = Field(default=None, description="only 0 is supported", strict=True)
    logprobs: Any = Field(default=None, description="not supported")
    user: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingRequest:
        if self.n not in (None, 1):
            raise ValueError("n: only n=1 is supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name}: not supported (only 0)")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs: not supported")
        return self

    def stop_list(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    model: str = Field(description="the function, written namespace/name", min_length=1, max_length=253)
    prompt: Text | list[Text] | list[TokenId] = Field(description="one prompt: text, [text] or token ids")
    echo: StrictBool | None = Field(default=None, description="not supported")
    best_of: StrictInt | None = Field(default=None, description="only 1 is supported")
    suffix: str | None = Field(default=None, description="not supported")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("empty prompt")
        return v

    @model_validator(mode="after")
    def _unsupported_completion(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only 1 is supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = Field(default=None, max_length=64)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    model: str = Field(description="the function, written namespace/name", min_length=1, max_length=253)
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, description="alias of max_tokens")
    tools: list[Any] | None = Field(default=None, description="not supported")

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools: not supported")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class InvokeRequest(SamplingRequest):
    """POST /v1/functions/{namespace}/{name}:invoke — give `prompt` or `messages` (chat template)."""

    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _one_input(self) -> InvokeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class InvokeTiming(BaseModel):
    ttft_ms: float | None
    total_ms: float
    cold_start: bool = Field(description="no live worker when the request arrived")


class InvokeResponse(BaseModel):
    id: str
    function: str
    text: str
    finish_reason: str
    usage: Usage
    timing: InvokeTiming


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
