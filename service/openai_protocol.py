"""OpenAI wire format: the request bodies we accept and the responses and stream chunks we send, as pydantic models.

Responses dump with every field present (null where unset, as OpenAI sends them), except the fields a model names
in `omit_if_none`, which OpenAI leaves out when they are empty (a chunk's usage, a delta's role or content).
"""

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer
from transformers import PreTrainedTokenizerBase

from inkwell.models.tokenizer import chat_role
from inkwell.serving.contract import SamplingParams, TokenLogprob
from inkwell.serving.limits import MAX_LOGPROBS, SEED_MAX, SEED_MIN


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # any 64-bit integer, signed or unsigned (the engines mix it into each choice's generator); others are a 400
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, strict=True)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> str | None:
        """The first parameter set to something this server does not do (rather than silently ignore it)."""
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty" if self.presence_penalty else "frequency_penalty"
        return "logit_bias" if self.logit_bias else None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            n=self.n,
            stop=self.stop_strings(),
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):
            return "best_of"
        return super().unsupported()

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_form(cls, prompt: object) -> object:
        """Named when it is none of the four forms (the union's own error names one of its branches: prompt.str)."""

        def token(item: object) -> bool:
            return isinstance(item, int) and not isinstance(item, bool)

        if isinstance(prompt, str) or (
            isinstance(prompt, list)
            and (
                all(isinstance(p, str) for p in prompt)
                or all(token(p) for p in prompt)
                or all(isinstance(p, list) and all(token(t) for t in p) for p in prompt)
            )
        ):
            return prompt
        raise ValueError("give a string, a list of strings, a list of token ids, or a list of lists of token ids")

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts, one list of texts or token ids however they were given (one, or a batch)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]]

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        """A turn Inkling's chat format has ("developer", OpenAI's newer name for the system turn, opens it)."""
        return chat_role(role)

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        """Inkling reads text: an image or audio part is refused rather than dropped from the prompt."""
        for part in [] if isinstance(content, str) else content:
            if part.get("type") != "text":
                raise ValueError(f"a content part of type {part.get('type')!r}: Inkling reads text parts only")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text part needs its 'text' string")
        return content

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # checked here under the names the client sent (the engine knows them as max_tokens and logprobs); a chat
    # has no echo, so no use for max_tokens 0
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # what the engine does not do, named so that setting it is refused rather than ignored: no tool calls, no
    # constrained decoding ("none" and {"type": "text"} ask for nothing, and are accepted)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        asked = {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none"),
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none"),
            "response_format": self.response_format not in (None, {"type": "text"}),
        }
        return next((name for name, given in asked.items() if given), None) or super().unsupported()

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ------------------------------------------------------------------------------------


class Wire(BaseModel):
    """A response object: dumped with its nulls, but without the `omit_if_none` fields that are None."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def omit_empty(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        for name in self.omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class Usage(Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(Wire):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def __add__(self, other: "CompletionLogprobs") -> "CompletionLogprobs":
        return CompletionLogprobs(
            tokens=self.tokens + other.tokens,
            token_logprobs=self.token_logprobs + other.token_logprobs,
            top_logprobs=self.top_logprobs + other.top_logprobs,
            text_offset=self.text_offset + other.text_offset,
        )


class CompletionChoice(Wire):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Envelope(Wire):
    """What every response and stream chunk carries around its choices (usage: on the last one, if at all)."""

    omit_if_none = ("usage",)

    id: str
    created: int
    model: str
    usage: Usage | None = None


class Completion(Envelope):
    """A /v1/completions response, or (streaming) one chunk of it."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatTokenLogprob(Wire):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprobs(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob]


class ChatLogprobs(Wire):
    content: list[ChatTokenLogprobs]


class ChatMessageOut(Wire):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Wire):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(Wire):
    omit_if_none = ("role", "content")

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Wire):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    logprobs: list[float | None],
    tops: list[list[tuple[int, float]] | None],
    offset: int,
) -> CompletionLogprobs:
    """The completions `logprobs` object for these tokens; their text starts at character `offset`."""
    tokens, offsets = [], []
    for token_id in ids:
        offsets.append(offset)
        tokens.append(token_text(tokenizer, token_id))
        offset += len(tokenizer.decode([token_id], skip_special_tokens=True))
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=list(logprobs),
        top_logprobs=[None if top is None else {token_text(tokenizer, t): lp for t, lp in top} for top in tops],
        text_offset=offsets,
    )


def step_logprobs(tokenizer: PreTrainedTokenizerBase, steps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    return completion_logprobs(
        tokenizer, [s.token_id for s in steps], [s.logprob for s in steps], [s.top for s in steps], offset
    )


def _chat_token(tokenizer: PreTrainedTokenizerBase, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": None if "\ufffd" in text else list(text.encode())}


def chat_logprobs(tokenizer: PreTrainedTokenizerBase, steps: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprobs(
                **_chat_token(tokenizer, s.token_id, s.logprob),
                top_logprobs=[ChatTokenLogprob(**_chat_token(tokenizer, t, lp)) for t, lp in s.top],
            )
            for s in steps
        ]
    )


def error_body(status: int, code: str, message: str, param: str | None = None, **details) -> dict:
    """OpenAI's error object, plus inkwell's `details` (so both conventions read it)."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {
        "error": {
            "message": message,
            "type": kind,
            "code": code,
            "param": param,
            "details": {"retryable": status in (429, 503), **details},
        }
    }
