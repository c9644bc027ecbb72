"""The native engine: continuous batching of Inkling generation with a LoRA adapter per request.

Requests join and leave between steps. Each step packs the decode token of every running
sequence and prefill chunks of new ones (up to `max_batch_tokens`) into one forward, whatever
their adapters: the per-token slot index selects each token's LoRA. A request is bound to its
adapter's slot when it is admitted, so an adapter version loaded later never changes a running
request; copying an adapter into a slot happens between steps and touches only that slot.
On CUDA, steps in which every sequence decodes one token replay a captured CUDA graph
(`CudaGraphDecoder`); steps with prefill chunks run the eager forward. Every step picks its tokens on
the device (greedy, or drawn at a uniform from the sequence's own generator); while no sequence needs
its logits on the host (logprobs), the next step is queued before this one's tokens reach the host
(`Engine.step`), so the host's work per step hides behind the GPU's.
"""

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.spec import TARGET_GROUPS
from inkwell.models import base_model_identity, load_base_config, load_base_weights, load_tokenizer, stop_token_ids
from inkwell.service.engine.graphs import CudaGraphDecoder
from inkwell.service.engine.lora import LoraSlots
from inkwell.service.engine.model import ForwardBatch, InklingModel, Segment
from inkwell.service.engine.sampling import SamplingParams, make_generator, sample_rows, token_logprobs
from inkwell.service.engine.state import StatePool
from inkwell.service.engine.streams import SideStream
from inkwell.service.engine.text import TextTracker


class EngineError(ValueError):
    """A request the engine refuses; `code` is machine-readable, `param` names the offending field."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


def context_error(prompt_len: int, max_tokens: int | None, max_context: int) -> EngineError | None:
    """Why a prompt and max_tokens do not fit the context (None: they fit; max_tokens None takes the rest)."""
    needed = prompt_len + (1 if max_tokens is None else max_tokens)
    if needed <= max_context and prompt_len <= max_context:
        return None
    prompt_alone = prompt_len + (0 if max_tokens == 0 else 1) > max_context
    return EngineError(
        "context_length_exceeded",
        f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}; together they must fit the "
        f"model's context of {max_context} tokens (shorten the prompt or lower max_tokens)",
        "prompt" if prompt_alone else "max_tokens",
    )


def validate_request(request: "Request", adapters, vocab: int, max_context: int, max_seqs: int) -> None:
    """Every engine's checks of a request before any work: sampling params, adapter, prompt, context, n."""
    params = request.params
    params.validate()
    if request.adapter is not None and request.adapter not in adapters:
        raise EngineError("adapter_not_loaded", f"adapter {request.adapter!r} is not loaded", "model")
    if not request.prompt_ids:
        raise EngineError("empty_prompt", "the prompt has no tokens", "prompt")
    if any(not 0 <= t < vocab for t in request.prompt_ids):
        raise EngineError("invalid_token", f"prompt token ids must be in [0, {vocab})", "prompt")
    error = context_error(len(request.prompt_ids), params.max_tokens, max_context)
    if error is not None:
        raise error
    if params.n > max_seqs:
        raise EngineError("invalid_n", f"n must be at most {max_seqs} on this engine", "n")


def make_room(adapters, limit: int, pinned: set[str], in_use, unload) -> None:
    """Unload idle (unpinned, unused) adapters in `adapters` order, least recently used first, until fewer
    than `limit` remain; EngineError too_many_adapters when every one is pinned or in use."""
    while len(adapters) >= limit:
        idle = [k for k in adapters if k not in pinned and not in_use(k)]
        if not idle:
            raise EngineError(
                "too_many_adapters",
                f"{len(adapters)} adapters are loaded and all are pinned or in use (raise max_loaded_adapters)",
            )
        unload(idle[0])


def check_unload(adapters, key: str, in_use) -> None:
    """EngineError unless `key` is loaded and no queued or running request uses it."""
    if key not in adapters:
        raise EngineError("adapter_not_loaded", f"adapter {key!r} is not loaded")
    if in_use(key):
        raise EngineError("adapter_busy", f"adapter {key!r} has queued or running requests")


@dataclass(frozen=True)
class EngineConfig:
    max_loras_per_batch: int = 4
    max_lora_rank: int = 64
    max_loaded_adapters: int = 16
    lora_groups: tuple[str, ...] = TARGET_GROUPS
    max_seqs: int = 16
    max_batch_tokens: int = 256
    max_context: int | None = None  # default: the model's max_position_embeddings
    dtype: str = "float32"
    device: str = "cpu"
    cuda_graphs: bool = True  # CUDA only: pure decode steps replay captured graphs
    # CUDA only: LoRA work beside the base GEMMs on a second stream. Off by default: since decode projections take
    # one launch each (lora_linear), its forks and joins cost graph decode more than they hide (docs/benchmarks.md)
    lora_side_stream: bool = False
    # Queue the next decode step before reading this one's tokens on the host (see `Engine.step`).
    overlap_decode: bool = True


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # key of an adapter added with `load_adapter`; None = base model


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StepOutput:
    """What one choice of a request produced in one step (deltas), and how it ended if it did."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    prompt_logprobs: list[float | None] | None = None  # first output only; [0] is None (no context)
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # with SamplingParams.logprobs = k


@dataclass(eq=False)  # a sequence is itself: `in` and `remove` compare identities
class _Sequence:
    request: Request
    index: int
    tokens: list[int]
    generator: torch.Generator
    text: TextTracker
    computed: int = 0
    seq_slot: int = -1
    lora_slot: int = -1
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=lambda: [[]])
    pending: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    text_delta: str = ""

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt :]


@dataclass(frozen=True, eq=False)
class _Chunk:
    """A sequence's rows in a step: `length` tokens from position `start`, at batch rows from `first`; `yields`:
    its last row gives the sequence's next token (not a prompt chunk that more chunks follow)."""

    seq: _Sequence
    first: int
    start: int
    length: int
    yields: bool

    @property
    def last_row(self) -> int:
        return self.first + self.length - 1


@dataclass(eq=False)
class _Launched:
    """A step queued on the device: its chunks, the index among its logits of each batch row it scores, their next
    tokens (greedy or drawn) on the device and on the host (there once `ready` has fired; None: already there),
    and the host logits where a row reports logprobs."""

    chunks: list[_Chunk]
    row_of: dict[int, int]
    tokens: torch.Tensor
    host_tokens: torch.Tensor
    ready: torch.cuda.Event | None
    logits: torch.Tensor | None


class Engine:
    """Load a base model directory, add adapters, add requests, call `step()` until idle."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.model_config = load_base_config(model_dir)
        self.identity = base_model_identity(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.stop_ids = tuple(stop_token_ids(self.tokenizer))
        dtype = getattr(torch, config.dtype)
        device = torch.device(config.device)
        self.max_context = min(config.max_context or 1 << 62, self.model_config.max_position_embeddings)
        self.model = InklingModel(self.model_config, load_base_weights(model_dir), dtype=dtype, device=device)
        graphs = config.cuda_graphs and device.type == "cuda"
        if config.lora_side_stream and device.type == "cuda":
            self.model.lora_stream = SideStream(device)
        # The graph decoder keeps one extra state slot for its padding rows.
        self.state = StatePool(self.model_config, config.max_seqs + int(graphs), self.max_context, dtype, device)
        self.lora = LoraSlots(
            self.model_config,
            self.identity,
            config.max_loras_per_batch,
            config.max_lora_rank,
            config.lora_groups,
            dtype,
            device,
        )
        self.decoder = CudaGraphDecoder(self.model, self.state, self.lora, config.max_seqs) if graphs else None
        self.device = device
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()
        self._pinned: set[str] = set()
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self._queued: _Launched | None = None  # the next step, already on the device (see `step`)
        self.steps = 0

    # ---- adapters ----------------------------------------------------------------------------

    def load_adapter(self, key: str, adapter: Adapter, pinned: bool = False) -> None:
        """Make `adapter` servable under `key` (a new key per version); pinned adapters keep their slot."""
        self.lora.check(adapter)
        if key in self.adapters:
            raise EngineError("adapter_exists", f"adapter {key!r} is already loaded; unload it or use a new key")
        if pinned and not self.lora.can_place(key):
            raise EngineError(
                "no_free_slot",
                f"all {self.config.max_loras_per_batch} adapter slots are pinned or in use, so {key!r} cannot be "
                "pinned (unpin or unload an adapter, or raise max_loras_per_batch)",
            )
        self._make_room()
        self.adapters[key] = adapter
        if pinned:
            self.lora.place(key, adapter)
            self.lora.pin(key)
            self._pinned.add(key)

    def _in_use(self, key: str) -> bool:
        return any(s.request.adapter == key for s in itertools.chain(self.waiting, self.running))

    def _make_room(self) -> None:
        make_room(self.adapters, self.config.max_loaded_adapters, self._pinned, self._in_use, self.unload_adapter)

    def unload_adapter(self, key: str) -> None:
        check_unload(self.adapters, key, self._in_use)
        if self.lora.slot_of(key) is not None:
            self.lora.evict(key)
        self._pinned.discard(key)
        del self.adapters[key]

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (validated here, so errors surface before any work)."""
        params = request.params
        validate_request(request, self.adapters, self.model_config.vocab_size, self.max_context, self.config.max_seqs)
        for index in range(params.n):
            self.waiting.append(
                _Sequence(
                    request=request,
                    index=index,
                    tokens=list(request.prompt_ids),
                    generator=make_generator(params.seed, index),
                    text=TextTracker(self.tokenizer, params.stop),
                    prompt_logprobs=[None] if params.prompt_logprobs else None,
                )
            )

    def abort(self, request_id: str) -> list[StepOutput]:
        """Drop a request's queued and running choices; returns their final outputs."""
        outputs = []
        for seq in [s for s in self.waiting if s.request.request_id == request_id]:
            self.waiting.remove(seq)
            outputs.append(self._output(seq, "abort"))
        for seq in [s for s in self.running if s.request.request_id == request_id]:
            self._finish(seq)
            outputs.append(self._output(seq, "abort"))
        return outputs

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- scheduling --------------------------------------------------------------------------

    def _admit(self) -> None:
        blocked: list[_Sequence] = []
        while self.waiting and self.state.free_slots:
            seq = self.waiting.popleft()
            key = seq.request.adapter
            if key is not None:
                if not self.lora.can_place(key):
                    blocked.append(seq)
                    continue
                self.lora.place(key, self.adapters[key])
                seq.lora_slot = self.lora.acquire(key)
                self.adapters.move_to_end(key)  # host copies are evicted least recently used first
            seq.seq_slot = self.state.acquire()
            self.running.append(seq)
        self.waiting.extendleft(reversed(blocked))

    def _can_admit(self) -> bool:
        """Whether `_admit` would admit a waiting sequence now (a free state slot, and its adapter placeable)."""
        if not self.state.free_slots:
            return False
        return any(s.request.adapter is None or self.lora.can_place(s.request.adapter) for s in self.waiting)

    def _finish(self, seq: _Sequence) -> None:
        self.running.remove(seq)
        self.state.release(seq.seq_slot)
        if seq.request.adapter is not None:
            self.lora.release(seq.request.adapter)

    def step(self) -> list[StepOutput]:
        """Run one forward over every running sequence; returns each choice's new output.

        Decoding overlaps steps: before this step's tokens are read on the host, the next step is queued on the
        device with those tokens as its input (`overlap_decode`), so the host's work of a step (reading its
        tokens, stop checks, detokenizing, the next launch) runs while the GPU computes the next one. Steps with
        a row that reports logprobs wait for their logits instead."""
        current, self._queued = self._queued, None
        if current is not None and not any(c.seq in self.running for c in current.chunks):
            current = None  # every sequence it decoded ended (or was aborted) after it was queued
        if current is None:
            self._admit()
            if not self.running:
                return []
            current = self._launch(*self._plan())
        follow_up = self._follow_up(current)
        if follow_up is not None:
            self._queued = self._launch(*follow_up)
        return self._collect(current)

    def _plan(self) -> tuple[list[_Chunk], list[int], list[int]]:
        """The next step's chunks (every decoding sequence first, then prefill chunks up to the token budget),
        their input ids and the rows whose logits it scores."""
        chunks: list[_Chunk] = []
        budget = self.config.max_batch_tokens
        decoding = [s for s in self.running if len(s.tokens) - s.computed == 1]
        prefilling = [s for s in self.running if len(s.tokens) - s.computed > 1]
        rows = 0
        for seq in decoding + prefilling:
            length = min(len(seq.tokens) - seq.computed, max(budget - rows, 1 if seq in decoding else 0))
            if length <= 0:
                continue
            chunks.append(_Chunk(seq, rows, seq.computed, length, seq.computed + length == len(seq.tokens)))
            rows += length
        ids, logit_rows = [], []
        for c in chunks:
            seq = c.seq
            ids += seq.tokens[c.start : c.start + c.length]
            if seq.prompt_logprobs is not None and c.start < seq.num_prompt:
                logit_rows += range(c.first, c.first + c.length)
            elif c.yields:
                logit_rows.append(c.last_row)
        return chunks, ids, logit_rows

    def _follow_up(self, current: "_Launched") -> tuple[list[_Chunk], torch.Tensor, list[int]] | None:
        """The decode step after `current` while `current` is still on the device, if it can be planned now: every
        running sequence is in `current`, gets its next token from it and needs no logits on the host (no
        logprobs), and no waiting request could be admitted. Sequences that `current`'s token ends by length are
        left out; one that a stop token or string ends is decoded once more and the result dropped."""
        if not self.config.overlap_decode or self._can_admit():
            return None
        if current.logits is not None or len(current.chunks) != len(self.running):
            return None
        chunks, sources = [], []
        for c in current.chunks:
            seq, end = c.seq, c.start + c.length
            if not c.yields or seq not in self.running:
                return None  # a prompt still prefilling in chunks, or a sequence aborted since
            if self._ends_by_length(seq, end + 1):  # with the token `current` gives it
                continue
            chunks.append(_Chunk(seq, len(chunks), end, 1, True))
            sources.append(current.row_of[c.last_row])
        if not chunks:
            return None
        if sources == list(range(len(sources))):
            ids = current.tokens[: len(sources)]
        else:
            ids = current.tokens[torch.tensor(sources, device=self.device)]
        return chunks, ids, list(range(len(chunks)))

    def _needs_logits(self, seq: _Sequence) -> bool:
        """Whether a step must bring `seq`'s logits to the host: to report logprobs."""
        return seq.request.params.logprobs is not None or seq.prompt_logprobs is not None

    def _launch(self, chunks: list[_Chunk], ids: list[int] | torch.Tensor, logit_rows: list[int]) -> "_Launched":
        """Queue a step's forward on the device; returns before it ends unless some row needs its logits."""
        seq_slots = [c.seq.seq_slot for c in chunks]
        if self.decoder is not None and len(ids) == len(chunks) == len(logit_rows):  # one token each, all scored
            logits, greedy = self.decoder(ids, seq_slots, [c.start for c in chunks], [c.seq.lora_slot for c in chunks])
        else:
            device = self.device
            batch = ForwardBatch(
                input_ids=ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long, device=device),
                lora_slots=torch.tensor(
                    [c.seq.lora_slot for c in chunks for _ in range(c.length)], dtype=torch.long, device=device
                ),
                segments=[Segment(slot, c.start, c.length) for slot, c in zip(seq_slots, chunks, strict=True)],
                logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
            )
            logits = self.model.forward(batch, self.state, self.lora)
            greedy = logits.argmax(-1)
        row_of = {r: i for i, r in enumerate(logit_rows)}
        tokens = self._draw(chunks, row_of, logits, greedy)
        host_logits = logits.cpu() if any(self._needs_logits(c.seq) for c in chunks) else None
        ready = None
        if tokens.is_cuda:  # the tokens come back through pinned memory, so the host need not wait here
            ready = torch.cuda.Event()
            host_tokens = tokens.to("cpu", non_blocking=True)
            ready.record()
        else:
            host_tokens = tokens.clone()
        return _Launched(chunks, row_of, tokens, host_tokens, ready, host_logits)

    def _draw(
        self, chunks: list[_Chunk], row_of: dict[int, int], logits: torch.Tensor, greedy: torch.Tensor
    ) -> torch.Tensor:
        """Each scored row's next token on the device: greedy, or for a sequence that samples, drawn at a uniform
        from its own generator (one draw per token it yields, so the same alone or in any batch)."""
        draws = [c for c in chunks if c.yields and c.seq.request.params.temperature > 0.0]
        if not draws:
            return greedy
        rows = [row_of[c.last_row] for c in draws]
        params = [c.seq.request.params for c in draws]
        uniforms = [float(torch.rand((), generator=c.seq.generator)) for c in draws]
        packed = torch.tensor(
            [rows, [p.temperature for p in params], [p.top_p for p in params], uniforms], dtype=torch.float64
        ).to(self.device, non_blocking=True)
        index = packed[0].long()
        drawn = sample_rows(logits[index], *packed[1:].float())
        return greedy.index_copy(0, index, drawn)

    def _collect(self, launched: "_Launched") -> list[StepOutput]:
        """Wait for a launched step's tokens and advance each of its sequences still running."""
        if launched.ready is not None:
            launched.ready.synchronize()
        self.steps += 1
        row_of = launched.row_of
        outputs = []
        for c in launched.chunks:
            seq = c.seq
            if seq not in self.running:
                continue  # ended while this step was queued
            seq.computed = c.start + c.length
            if seq.prompt_logprobs is not None and c.start < seq.num_prompt:
                rows = [row_of[r] for r in range(c.first, c.first + c.length)]
                self._record_prompt_logprobs(seq, launched.logits, rows, c.start)
            if seq.computed < len(seq.tokens):
                continue
            if seq.request.params.max_tokens == 0:  # scoring the prompt only
                self._finish(seq)
                outputs.append(self._output(seq, "length"))
                continue
            row = row_of[c.last_row]
            logits = launched.logits[row] if launched.logits is not None else None
            out = self._advance(seq, int(launched.host_tokens[row]), logits)
            if out is not None:
                outputs.append(out)
        return outputs

    def _record_prompt_logprobs(self, seq: _Sequence, logits: torch.Tensor, rows: list[int], start: int) -> None:
        log_probs = torch.log_softmax(logits[rows], dim=-1)
        top = seq.request.params.logprobs
        for i in range(len(rows)):
            target = start + i + 1
            if target < seq.num_prompt:
                chosen, best = token_logprobs(log_probs[i], seq.tokens[target], top)
                seq.prompt_logprobs.append(chosen)
                seq.prompt_top_logprobs.append(best)

    def _ends_by_length(self, seq: _Sequence, tokens: int) -> bool:
        """Whether `seq` holding `tokens` tokens (prompt included) has reached max_tokens or the context."""
        max_tokens = seq.request.params.max_tokens
        return tokens >= self.max_context or (max_tokens is not None and tokens - seq.num_prompt >= max_tokens)

    def _advance(self, seq: _Sequence, token: int, logits: torch.Tensor | None) -> StepOutput | None:
        """Append the sequence's next token (its logprobs from the host `logits` where the request asks)."""
        params = seq.request.params
        if params.logprobs is not None:
            chosen, top = token_logprobs(torch.log_softmax(logits, dim=-1), token, params.logprobs)
            seq.pending_logprobs.append(TokenLogprob(token, chosen, top))
        seq.tokens.append(token)
        seq.pending.append(token)
        is_stop_token = token in self.stop_ids and not params.ignore_eos
        is_stop_token |= token in params.stop_token_ids
        generated = seq.generated[:-1] if is_stop_token else seq.generated
        at_length = self._ends_by_length(seq, len(seq.tokens))
        final = is_stop_token or at_length
        seq.text_delta, hit_stop = seq.text.update(generated, final)
        reason = "stop" if is_stop_token or hit_stop else "length" if at_length else None
        if reason is not None:
            self._finish(seq)
            return self._output(seq, reason)
        if not seq.text_delta and params.logprobs is None:
            return None  # nothing final to show yet (held back); the tokens go out with the next output
        return self._output(seq, None)

    def _output(self, seq: _Sequence, reason: str | None) -> StepOutput:
        text, seq.text_delta = seq.text_delta, ""
        out = StepOutput(
            request_id=seq.request.request_id,
            index=seq.index,
            token_ids=seq.pending,
            text=text,
            logprobs=seq.pending_logprobs,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt,
            completion_tokens=len(seq.generated),
            prompt_logprobs=seq.prompt_logprobs,
            prompt_top_logprobs=seq.prompt_top_logprobs if seq.prompt_logprobs is not None else None,
        )
        seq.pending, seq.pending_logprobs, seq.prompt_logprobs = [], [], None
        return out

    # ---- convenience -------------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> dict[str, list["Choice"]]:
        """Add `requests`, step until all finish, and gather each request's choices (by index)."""
        for request in requests:
            self.add_request(request)
        choices: dict[str, dict[int, Choice]] = {r.request_id: {} for r in requests}
        while self.has_work():
            for out in self.step():
                if out.request_id in choices:
                    choices[out.request_id].setdefault(out.index, Choice()).extend(out)
        return {rid: [c[i] for i in sorted(c)] for rid, c in choices.items()}


@dataclass
class Choice:
    """A finished choice: all its tokens, text, logprobs and why it ended."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    def extend(self, out: StepOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs
        self.finish_reason = out.finish_reason or self.finish_reason
        self.prompt_tokens = out.prompt_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
