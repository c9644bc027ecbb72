"""OpenAI wire format: the request bodies we accept and the responses and stream chunks we send."""

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from inkwell.serving.contract import SamplingParams, TokenLogprob


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
    seed: int | None = None
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
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str] | list[list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer, ids: list[int], logprobs: list, tops: list[list[tuple[int, float]] | None], offset: int
) -> dict:
    """The completions `logprobs` object for these tokens; their text starts at character `offset`."""
    tokens, offsets = [], []
    for token_id in ids:
        offsets.append(offset)
        tokens.append(token_text(tokenizer, token_id))
        offset += len(tokenizer.decode([token_id], skip_special_tokens=True))
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [None if top is None else {token_text(tokenizer, t): lp for t, lp in top} for top in tops],
        "text_offset": offsets,
    }


def step_logprobs(tokenizer, steps: list[TokenLogprob], offset: int) -> dict:
    return completion_logprobs(
        tokenizer, [s.token_id for s in steps], [s.logprob for s in steps], [s.top for s in steps], offset
    )


def join_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def _chat_token(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    raw = None if "\ufffd" in text else list(text.encode())
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(tokenizer, steps: list[TokenLogprob]) -> dict:
    content = []
    for s in steps:
        entry = _chat_token(tokenizer, s.token_id, s.logprob)
        entry["top_logprobs"] = [_chat_token(tokenizer, t, lp) for t, lp in s.top]
        content.append(entry)
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(kind: str, rid: str, model: str, choices: list[dict], created: int | None = None) -> dict:
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model, "choices": choices}


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
