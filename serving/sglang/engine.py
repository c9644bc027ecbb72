"""The `sglang` engine: SGLang 0.5.23's offline Engine behind our `ServingEngine` interface.

Install with `pip install 'inkwell[sglang]'` on a CUDA machine. The engine writes the base model
as a released-format checkpoint (serving/sglang/checkpoint.py) into a temporary folder and
starts SGLang on it with LoRA enabled. Adapters go in through `load_lora_adapter_from_tensors` in
our `sglang` layout; each choice of a request is one streaming SGLang request with its adapter's
name as `lora_path`.

SGLang runs its scheduler in subprocesses and its tokenizer manager on an asyncio loop in this
process (`Engine.loop`); `step()` runs that loop until some request has new tokens (or a short
timeout), then turns the new tokens into `StepOutput`s exactly as the native engine does: stop
tokens, max_tokens, the context limit and stop strings (held back while they may still match)
are all decided here, token by token, so the two engines agree on where and why a choice ends.
SGLang is started with `skip_tokenizer_init`: it sees token ids only, and stops early on the same
stop tokens and max_tokens as an optimisation; a choice we end first is aborted in SGLang.
Logprobs are those of the model's distribution before temperature, as in the native engine
(SGLANG_RETURN_ORIGINAL_LOGPROB). Sampling at temperature > 0 uses SGLang's sampler, so seeded
draws differ from the native engine's; greedy decoding is the same model's argmax.
"""

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.layouts.sglang import SGLANG_MODULES, SglangLayoutError, to_sglang
from inkwell.models import base_model_identity, load_base_config, load_tokenizer, stop_token_ids
from inkwell.serving.contract import (
    AdapterIncompatibleError,
    EngineConfig,
    EngineError,
    Request,
    SamplingParams,
    StepOutput,
    TokenLogprob,
)
from inkwell.serving.rules import AdapterTable, Finisher, check_routing, context_limit, validate_request
from inkwell.serving.sglang.checkpoint import write_sglang_checkpoint
from inkwell.serving.slot_copy import check_adapter, slot_layout

log = logging.getLogger("inkwell.serving")

INSTALL_HINT = "pip install 'inkwell[sglang]'"
POLL_SECONDS = 0.02  # longest step() waits for new tokens, so the worker keeps draining its inbox


class SglangUnavailableError(ImportError):
    """SGLang (the `sglang` extra) is not installed or cannot be imported here."""


def import_sglang_engine() -> type:
    """SGLang's offline `Engine` class, imported only when an `sglang` engine is started."""
    try:
        from sglang.srt.entrypoints.engine import Engine
    except ImportError as exc:
        raise SglangUnavailableError(
            f"the 'sglang' engine needs SGLang 0.5.23, which cannot be imported here ({exc}); "
            f"install it with `{INSTALL_HINT}` on a machine with a CUDA GPU"
        ) from exc
    return Engine


def server_args(model_path: str | Path, config: EngineConfig, max_context: int) -> dict[str, Any]:
    """SGLang `Engine(**kwargs)` for our EngineConfig: LoRA on, our limits, token ids in and out."""
    device, _, index = config.device.partition(":")
    if device != "cuda":
        raise ValueError(f"the 'sglang' engine runs on a CUDA device, not {config.device!r}; use the 'native' engine")
    return {
        "model_path": str(model_path),
        "device": "cuda",
        "base_gpu_id": int(index or 0),
        "dtype": config.dtype,
        "context_length": max_context,
        "max_running_requests": config.max_seqs,
        "skip_tokenizer_init": True,
        "enable_lora": True,
        "max_lora_rank": config.max_lora_rank,
        "lora_target_modules": sorted({m for group in config.lora_groups for m in SGLANG_MODULES[group]}),
        "max_loras_per_batch": config.max_loras_per_batch,
        "experts_shared_outer_loras": True,  # our layout's w1/w3 A and w2 B have expert dim 1
        "lora_backend": "triton",  # Inkling's shared-sink LoRA needs it for more than one adapter per batch
        "log_level": "error",
    }


def sglang_sampling_params(params: SamplingParams, index: int, finisher: Finisher) -> dict:
    """SGLang sampling params of choice `index`: the tokens SGLang may stop on are those `finisher` ends on.

    Stop strings are not passed (SGLang has no tokenizer here); this engine ends on them itself.
    """
    rest = finisher.max_context - finisher.prompt_len
    return {
        "max_new_tokens": params.max_tokens if params.max_tokens is not None else rest,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        # SGLang's ignore_eos also ignores stop_token_ids; then this engine ends on them and aborts
        "ignore_eos": params.ignore_eos,
        "stop_token_ids": sorted(finisher.stop_ids) or None,
        "sampling_seed": params.choice_seed(index),
    }


def token_logprobs_from_meta(meta: dict, start: int, count: int) -> list[TokenLogprob]:
    """TokenLogprobs of output tokens [start, start+count) from SGLang's (logprob, id, text) tuples."""
    chosen = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    out = []
    for i in range(start, start + count):
        logprob, token, _ = chosen[i]
        top = [(tid, tlp) for tlp, tid, _ in (tops[i] or [])] if i < len(tops) else []
        out.append(TokenLogprob(token, logprob, top))
    return out


def prompt_logprobs_from_meta(meta: dict, prompt_len: int) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """Prompt logprobs and per-position top lists from SGLang's input logprobs (SGLang's [0] is None too)."""
    chosen: list[float | None] = [lp for lp, _, _ in meta["input_token_logprobs"][:prompt_len]]
    tops = meta.get("input_top_logprobs") or []
    top_lists = [
        [(tid, tlp) for tlp, tid, _ in (tops[i] or [])] if 0 < i < len(tops) else [] for i in range(prompt_len)
    ]
    return chosen, top_lists


@dataclass
class ChoiceStream:
    """One choice of a request as SGLang streams it, turned into our StepOutputs token by token.

    `latest` is SGLang's newest chunk (its stream is cumulative: all output ids and logprobs so
    far); `collect` takes the tokens not seen yet and ends the choice where the native engine would.
    """

    request: Request
    index: int
    finisher: Finisher
    rid: str = ""
    task: asyncio.Task | None = None
    latest: dict | None = None
    error: BaseException | None = None
    stream_done: bool = False  # SGLang's stream ended (finished, aborted or failed)
    consumed: int = 0  # output tokens already taken from SGLang's chunks
    generated: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    text_delta: str = ""
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_sent: bool = False

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    def collect(self) -> StepOutput | None:
        """The output of the tokens SGLang produced since the last call, if there is one to show."""
        params = self.request.params
        meta = self.latest["meta_info"] if self.latest is not None else {}
        if params.prompt_logprobs and self.prompt_logprobs is None and meta.get("input_token_logprobs"):
            self.prompt_logprobs, self.prompt_top_logprobs = prompt_logprobs_from_meta(meta, self.num_prompt)
        new = list(self.latest["output_ids"][self.consumed :]) if self.latest is not None else []
        logprobs: list[TokenLogprob | None] = [None] * len(new)
        if params.logprobs is not None:
            logprobs = token_logprobs_from_meta(meta, self.consumed, len(new))
        self.consumed += len(new)
        for token, logprob in zip(new, logprobs, strict=True):
            reason = self._advance(token, logprob)
            if reason is not None:
                return self.output(reason)
        if self.stream_done:  # SGLang ended the choice before this engine's own rules did
            return self._end(meta)
        if self.text_delta or self.pending_logprobs:
            return self.output(None)
        return None  # nothing final to show yet (held back); the tokens go out with the next output

    def _advance(self, token: int, logprob: TokenLogprob | None) -> str | None:
        """Take one generated token; the finish reason if it ends the choice (as the native engine decides)."""
        self.generated.append(token)
        self.pending.append(token)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        delta, reason = self.finisher.advance(self.generated)
        self.text_delta += delta
        return reason

    def _end(self, meta: dict) -> StepOutput:
        if self.error is not None:
            log.error("SGLang request %s failed: %s", self.rid, self.error)
            reason = "abort"
        elif self.request.params.max_tokens == 0:  # scoring the prompt only
            reason = "length"
        else:
            reason = _finish_reason(meta.get("finish_reason"))
        delta, hit_stop = self.finisher.close(self.generated)
        self.text_delta += delta
        return self.output("stop" if hit_stop else reason)

    def output(self, reason: str | None) -> StepOutput:
        """The pending deltas as a StepOutput (prompt logprobs ride on the first one that has them)."""
        out = StepOutput(
            request_id=self.request.request_id,
            index=self.index,
            token_ids=self.pending,
            text=self.text_delta,
            logprobs=self.pending_logprobs,
            finish_reason=reason,
            prompt_tokens=self.num_prompt,
            completion_tokens=len(self.generated),
        )
        if self.prompt_logprobs is not None and not self.prompt_sent:
            out.prompt_logprobs, out.prompt_top_logprobs = self.prompt_logprobs, self.prompt_top_logprobs
            self.prompt_sent = True
        self.pending, self.pending_logprobs, self.text_delta = [], [], ""
        return out


class SglangEngine:
    """`ServingEngine` on SGLang: load a base model directory, add adapters and requests, call `step()`."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        engine_class = import_sglang_engine()
        self.model_dir = Path(model_dir)
        self.model_config = load_base_config(model_dir)
        self.identity = base_model_identity(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.stop_ids = tuple(stop_token_ids(self.tokenizer))
        self.max_context = context_limit(self.model_config, config.max_context)
        # what the native engine's adapter check reads (max rank, groups); SGLang keeps its own buffers
        self._layout = slot_layout(self.model_config, config.max_lora_rank, tuple(config.lora_groups), torch.bfloat16)
        self._table = AdapterTable(config.max_loaded_adapters, self._in_use)
        self.adapters = self._table.adapters
        self._choices: list[ChoiceStream] = []
        self._checkpoint = Path(tempfile.mkdtemp(prefix="inkwell-sglang-"))
        try:
            write_sglang_checkpoint(model_dir, self._checkpoint)
            os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # read by SGLang's scheduler processes
            self._sgl = engine_class(**server_args(self._checkpoint, config, self.max_context))
        except BaseException:
            shutil.rmtree(self._checkpoint, ignore_errors=True)
            raise
        self._loop: asyncio.AbstractEventLoop = self._sgl.loop
        self._ready = asyncio.Event()

    def shutdown(self) -> None:
        """Stop SGLang's processes and remove the converted checkpoint."""
        self._sgl.shutdown()
        shutil.rmtree(self._checkpoint, ignore_errors=True)

    # ---- adapters ----------------------------------------------------------------------------

    def load_adapter(self, key: str, adapter: Adapter, pinned: bool = False) -> None:
        """Convert `adapter` to the sglang layout and load it into SGLang under `key`.

        Pinned adapters are never evicted by this engine to make room (SGLang's own GPU-slot
        pinning is not used: its tensor loading API takes no pin).
        """
        check_adapter(adapter, self.identity, self._layout)
        self._table.check_new(key)
        try:
            tensors, adapter_config = to_sglang(adapter, self.model_config)
        except SglangLayoutError as exc:
            raise AdapterIncompatibleError(str(exc)) from exc
        self._table.make_room(self.unload_adapter)
        # host copies: SGLang caches adapters in host memory, and a worker's adapter may be a view of
        # the loader's staging ring on the GPU, which is reused once this call returns
        tensors = {name: tensor.cpu() for name, tensor in tensors.items()}
        result = self._sgl.load_lora_adapter_from_tensors(key, tensors, adapter_config)
        if not result.success:
            raise AdapterIncompatibleError(f"SGLang refused adapter {key!r}: {result.error_message}")
        self._table.add(key, adapter, pinned)

    def _in_use(self, key: str) -> bool:
        return any(c.request.adapter == key for c in self._choices)

    def unload_adapter(self, key: str) -> None:
        self._table.check_unload(key)
        result = self._sgl.unload_lora_adapter(key)
        if not result.success:
            raise EngineError("adapter_unload_failed", f"SGLang could not unload {key!r}: {result.error_message}")
        self._table.remove(key)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Validate as the native engine does (SGLang records no routing traces), then start one streaming SGLang
        request per choice."""
        params = request.params
        validate_request(request, self.adapters, self.model_config.vocab_size, self.max_context, self.config.max_seqs)
        check_routing(params, "sglang")
        if request.adapter is not None:
            self._table.touch(request.adapter)  # evicted least recently used first
        for index in range(params.n):
            choice = ChoiceStream(
                request,
                index,
                Finisher(self.tokenizer, params, len(request.prompt_ids), self.stop_ids, self.max_context),
                rid=f"{request.request_id}-{index}-{uuid.uuid4().hex[:8]}",
            )
            choice.task = self._loop.create_task(self._stream(choice))
            self._choices.append(choice)

    async def _stream(self, choice: ChoiceStream) -> None:
        params = choice.request.params
        sampling = sglang_sampling_params(params, choice.index, choice.finisher)
        try:
            stream = await self._sgl.async_generate(
                input_ids=list(choice.request.prompt_ids),
                sampling_params=sampling,
                lora_path=choice.request.adapter,
                rid=choice.rid,
                stream=True,
                return_logprob=params.logprobs is not None or params.prompt_logprobs,
                top_logprobs_num=params.logprobs or 0,
                logprob_start_len=0 if params.prompt_logprobs else -1,
            )
            async for chunk in stream:
                choice.latest = chunk
                self._ready.set()
        except Exception as exc:  # reported by step() as this choice's end
            choice.error = exc
        finally:
            choice.stream_done = True
            self._ready.set()

    def abort(self, request_id: str) -> list[StepOutput]:
        """Cancel a request's choices (SGLang aborts what it already scheduled); returns their final outputs."""
        choices = [c for c in self._choices if c.request.request_id == request_id]
        outputs = [c.output("abort") for c in choices]
        self._close(choices)
        return outputs

    def _close(self, choices: list[ChoiceStream]) -> None:
        """Forget `choices`; cancelling a stream SGLang still runs aborts it there."""
        for choice in choices:
            self._choices.remove(choice)
            choice.task.cancel()
        if choices:
            self._loop.run_until_complete(asyncio.gather(*(c.task for c in choices), return_exceptions=True))

    def has_work(self) -> bool:
        return bool(self._choices)

    def cache_stats(self) -> None:
        """None: SGLang keeps its own radix cache and reports it through its own metrics."""
        return None

    # ---- stepping ----------------------------------------------------------------------------

    async def _wait_for_output(self) -> None:
        await asyncio.sleep(0)
        if not self._ready.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), POLL_SECONDS)
        self._ready.clear()

    def step(self) -> list[StepOutput]:
        """Let SGLang run until some choice has new tokens; returns each choice's new output."""
        if not self._choices:
            return []
        self._loop.run_until_complete(self._wait_for_output())
        outputs: list[StepOutput] = []
        finished: list[ChoiceStream] = []
        for choice in list(self._choices):
            out = choice.collect()
            if out is not None:
                outputs.append(out)
                if out.finish_reason is not None:
                    finished.append(choice)
        self._close(finished)
        return outputs


def _finish_reason(sglang_reason: dict | None) -> str:
    """Our finish reason for SGLang's `meta_info.finish_reason` ({"type": "stop" | "length" | "abort", ...})."""
    kind = (sglang_reason or {}).get("type")
    return kind if kind in ("stop", "length") else "abort"
