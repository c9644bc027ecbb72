"""The native engine: continuous batching of Inkling generation with a LoRA adapter per request.

Requests join and leave between steps. Each step packs the decode token of every running
sequence and prefill chunks of new ones (up to `max_batch_tokens`) into one forward, whatever
their adapters: the per-token slot index selects each token's LoRA. A request is bound to its
adapter's slot when it is admitted, so an adapter version loaded later never changes a running
request; copying an adapter into a slot happens between steps and touches only that slot.
On CUDA, steps in which every sequence decodes one token replay a captured CUDA graph (`StepGraphs`), and so do
steps whose prefill chunks pad to at most `EngineConfig.graph_prefill_tokens` token places (every step of the
service's 256-token budget; a step of 8 x 1,024 tokens); larger prefill steps run the eager forward. Every step
picks its tokens on the device (greedy, or drawn at a uniform from the sequence's own generator); while no
sequence needs its logits on the host (logprobs), the next step is queued before this one's tokens reach the host
(`Engine.step`), so the host's work per step hides behind the GPU's. A request may ask for routing traces
(`SamplingParams.return_routing`, `prompt_routing`): every step's routed expert ids come back to the host beside
its tokens, and each token gets the routing of the forward that scored it (`inkwell.models.routing`).
With `EngineConfig.prefix_cache`, an admitted prompt starts from the longest prefix cached under its adapter
(`PrefixCache`), and a prompt that shares more with one still prefilling waits for that one's state there instead
of computing the same tokens (`_attach`): the n choices of a request, a GRPO group, a shared system prompt. A
sequence that reports its prompt's logprobs or routing, which the cache does not keep, computes its whole prompt
but still leaves its prefix in the cache; the prompt's routing is recorded by a request's first choice only (one
prompt, one routing), so its other choices, a GRPO group traced for routing replay, still prefill the prompt once.
"""

import itertools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from inkwell.adapters.adapter import Adapter
from inkwell.models import base_model_identity, load_base_config, load_base_weights, load_tokenizer, stop_token_ids
from inkwell.models.routing import RoutingShape
from inkwell.serving.contract import (
    Choice,
    EngineConfig,
    EngineError,
    PrefixCacheStats,
    Request,
    StepOutput,
    TokenLogprob,
    generate,
)
from inkwell.serving.native.graphs import StepGraphs
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.native.model import ForwardBatch, InklingModel, Segment
from inkwell.serving.native.prefix_cache import Match, PrefixCache, PrefixStore
from inkwell.serving.native.sampling import greedy_scores, make_generator, sample_rows, token_logprobs
from inkwell.serving.native.state import StatePool
from inkwell.serving.native.streams import SideStream
from inkwell.serving.rules import AdapterTable, Finisher, context_limit, validate_request


@dataclass(eq=False)  # a sequence is itself: `in` and `remove` compare identities
class _Sequence:
    request: Request
    index: int
    tokens: list[int]
    generator: torch.Generator
    finisher: Finisher
    computed: int = 0
    seq_slot: int = -1
    lora_slot: int = -1
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=lambda: [[]])
    prompt_routing: list[np.ndarray] | None = None  # per prompt chunk: the routing of the prompt tokens it scored
    pending: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_routing: list[np.ndarray] = field(default_factory=list)  # [1, MoE layers, top_k] per pending token
    text_delta: str = ""
    snaps: set[int] = field(default_factory=set)  # positions whose state goes into the prefix cache when passed
    leader: "_Sequence | None" = None  # held until `leader` has cached the prefix they share (to `hold_to`)
    hold_to: int = 0

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    def decode_order(self) -> int:
        """Where the sequence's row goes among a step's decode rows: grouped by adapter slot, so that a LoRA kernel's
        token tile holds one or two adapters, not every adapter of the batch."""
        return self.lora_slot


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
    the host logits where a row reports logprobs, and every batch row's routing [rows, MoE layers, top_k] on the
    host (there once `ready` has fired) where a sequence records routing."""

    chunks: list[_Chunk]
    row_of: dict[int, int]
    tokens: torch.Tensor
    host_tokens: torch.Tensor
    ready: torch.cuda.Event | None
    logits: torch.Tensor | None
    routing: torch.Tensor | None


class Engine:
    """Load a base model directory, add adapters, add requests, call `step()` until idle."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.model_config = load_base_config(model_dir)
        self.identity = base_model_identity(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.stop_ids = tuple(stop_token_ids(self.tokenizer))
        self.routing_shape = RoutingShape.of(self.model_config)
        dtype = getattr(torch, config.dtype)
        device = torch.device(config.device)
        self.max_context = context_limit(self.model_config, config.max_context)
        graphs = config.cuda_graphs and device.type == "cuda"
        # The step graphs keep one extra state slot for their padding rows.
        self.model, self.state, self.lora = self._parts(dtype, device, config.max_seqs + int(graphs))
        if config.lora_side_stream and device.type == "cuda":
            self.model.lora_stream = SideStream(device)
        self.graphs = StepGraphs.of(self.model, self.state, self.lora, config) if graphs else None
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache:
            self.prefix_cache = PrefixCache(self._prefix_store(), config.prefix_cache_bytes, config.prefix_cache_block)
        self.device = device
        self._table = AdapterTable(config.max_loaded_adapters, self._in_use)
        self.adapters = self._table.adapters
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self._queued: _Launched | None = None  # the next step, already on the device (see `step`)
        self.steps = 0

    def _parts(
        self, dtype: torch.dtype, device: torch.device, seq_slots: int
    ) -> tuple[InklingModel, StatePool, LoraSlots]:
        """The model, the state of `seq_slots` sequences and the adapter slots: here the whole model's."""
        config = self.config
        model = InklingModel(self.model_config, load_base_weights(self.model_dir), dtype=dtype, device=device)
        state = StatePool(self.model_config, seq_slots, self.max_context, dtype, device)
        lora = LoraSlots(
            self.model_config,
            self.identity,
            config.max_loras_per_batch,
            config.max_lora_rank,
            config.lora_groups,
            dtype,
            device,
        )
        return model, state, lora

    def _prefix_store(self) -> PrefixStore:
        """Where the prefix cache keeps its copies of the state: beside it, in this process."""
        return PrefixStore(self.state)

    def shutdown(self) -> None:
        """Release what the engine started beside this process (nothing here: it is all in this process)."""

    # ---- adapters ----------------------------------------------------------------------------

    def load_adapter(self, key: str, adapter: Adapter, pinned: bool = False) -> None:
        """Make `adapter` servable under `key` (a new key per version); pinned adapters keep their slot."""
        self.lora.check(adapter)
        self._table.check_new(key)
        if pinned and not self.lora.can_place(key):
            raise EngineError(
                "no_free_slot",
                f"all {self.config.max_loras_per_batch} adapter slots are pinned or in use, so {key!r} cannot be "
                "pinned (unpin or unload an adapter, or raise max_loras_per_batch)",
            )
        self._table.make_room(self.unload_adapter)
        self._table.add(key, adapter, pinned)
        if pinned:
            self.lora.place(key, adapter)
            self.lora.pin(key)

    def _in_use(self, key: str) -> bool:
        return any(s.request.adapter == key for s in itertools.chain(self.waiting, self.running))

    def unload_adapter(self, key: str) -> None:
        self._table.check_unload(key)
        if self.lora.slot_of(key) is not None:
            self.lora.evict(key)
        self._table.remove(key)
        if self.prefix_cache is not None:
            self.prefix_cache.drop(key)

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
                    generator=make_generator(params.choice_seed(index)),
                    finisher=Finisher(self.tokenizer, params, len(request.prompt_ids), self.stop_ids, self.max_context),
                    prompt_logprobs=[None] if params.prompt_logprobs else None,
                    prompt_routing=[] if params.prompt_routing and index == 0 else None,
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

    def cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters (None: the cache is off)."""
        return None if self.prefix_cache is None else self.prefix_cache.stats

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
                self._table.touch(key)  # host copies are evicted least recently used first
            seq.seq_slot = self.state.acquire()
            self._attach(seq)
            self.running.append(seq)
        self.waiting.extendleft(reversed(blocked))

    def _reads_cache(self, seq: _Sequence) -> bool:
        """Whether `seq` (admitted, nothing computed yet) may start from a cached prefix: not where it records its
        prompt's logprobs or routing, which the cache does not keep (such a prompt is computed whole)."""
        return self.prefix_cache is not None and seq.prompt_logprobs is None and seq.prompt_routing is None

    def _attach(self, seq: _Sequence) -> None:
        """Start a just admitted `seq` from the longest prefix of its prompt cached under its adapter, or hold it
        while a sequence already prefilling computes a longer prefix they share (it caches its state there). What
        `seq` then passes that others may share (where its prompt leaves the tree, its last whole block) is
        marked for the cache, also where `seq` computes its whole prompt (`_reads_cache`)."""
        if self.prefix_cache is None:
            return
        cache, prompt, adapter = self.prefix_cache, seq.request.prompt_ids, seq.request.adapter
        usable = cache.usable(seq.num_prompt)
        match = cache.lookup(adapter, prompt[:usable])
        if not self._reads_cache(seq):
            seq.snaps = self._snaps(match, usable)
            return
        leaders = [s for s in self.running if s is not seq and s.leader is None and s.request.adapter == adapter]
        for leader in leaders:
            other = leader.request.prompt_ids
            same = next((i for i, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b), len(prompt))
            shared = cache.aligned(min(same, usable, cache.usable(len(other))))
            if shared > match.length and leader.computed < shared:
                leader.snaps.add(shared)
                seq.leader, seq.hold_to = leader, shared
                return
        cache.attach(match, seq.seq_slot, seq.num_prompt)
        seq.computed = match.length
        seq.snaps = self._snaps(match, usable)

    def _snaps(self, match: Match, usable: int) -> set[int]:
        """Where a prompt's prefill leaves its state in the cache: where it leaves the tree (another prompt shares it
        up to there), and its last whole block (`usable`) where that lies more than `prefix_cache_min_gain` tokens
        further: a chunk ends at each, and one more costs a step now to save a later prompt that extends this one
        only those tokens."""
        first = max(match.length, match.shared)
        snaps = {first} if first > match.length else set()
        if usable - first > self.config.prefix_cache_min_gain:
            snaps.add(usable)
        return snaps

    def _release_held(self) -> None:
        """Attach each held sequence whose leader has passed the prefix they share (or ended)."""
        for seq in self.running:
            leader = seq.leader
            if leader is not None and (leader not in self.running or leader.computed >= seq.hold_to):
                seq.leader = None
                self._attach(seq)

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
            self._release_held()
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
        active = [s for s in self.running if s.leader is None]
        decoding = sorted((s for s in active if len(s.tokens) - s.computed == 1), key=_Sequence.decode_order)
        prefilling = [s for s in active if len(s.tokens) - s.computed > 1]
        rows = 0
        for seq in decoding + prefilling:
            length = min(len(seq.tokens) - seq.computed, max(budget - rows, 1 if seq in decoding else 0))
            snap = min((p for p in seq.snaps if p > seq.computed), default=None)
            if snap is not None:  # the chunk ends there, where the prefix cache reads the state
                length = min(length, snap - seq.computed)
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
        follows = []
        for c in current.chunks:
            seq, end = c.seq, c.start + c.length
            if not c.yields or seq not in self.running:
                return None  # a prompt still prefilling in chunks, or a sequence aborted since
            if seq.finisher.ends_by_length(end + 1):  # with the token `current` gives it
                continue
            follows.append((seq, end, current.row_of[c.last_row]))
        if not follows:
            return None
        follows.sort(key=lambda follow: follow[0].decode_order())
        chunks = [_Chunk(seq, row, end, 1, True) for row, (seq, end, _) in enumerate(follows)]
        sources = [source for _, _, source in follows]
        if sources == list(range(len(sources))):
            ids = current.tokens[: len(sources)]
        else:
            ids = current.tokens[torch.tensor(sources, device=self.device)]
        return chunks, ids, list(range(len(chunks)))

    def _needs_logits(self, seq: _Sequence) -> bool:
        """Whether a step must bring `seq`'s logits to the host: to report logprobs."""
        return seq.request.params.logprobs is not None or seq.prompt_logprobs is not None

    def _records_routing(self, seq: _Sequence) -> bool:
        """Whether a step must bring `seq`'s routing to the host."""
        return seq.request.params.return_routing or seq.prompt_routing is not None

    def _launch(self, chunks: list[_Chunk], ids: list[int] | torch.Tensor, logit_rows: list[int]) -> "_Launched":
        """Queue a step's forward on the device; returns before it ends unless some row needs its logits."""
        seq_slots = [c.seq.seq_slot for c in chunks]
        lora_slots = [c.seq.lora_slot for c in chunks]
        starts, lengths = [c.start for c in chunks], [c.length for c in chunks]
        records = any(self._records_routing(c.seq) for c in chunks)
        graphs = self.graphs
        row_of = {r: i for i, r in enumerate(logit_rows)}
        if graphs is not None and len(ids) == len(chunks) == len(logit_rows):  # one token each, all scored
            logits, greedy, routes = graphs.decode(ids, seq_slots, starts, lora_slots)
            table = routes() if records else None
        elif (
            graphs is not None
            and logit_rows == [c.last_row for c in chunks if c.yields]  # no prompt logprobs
            and graphs.extend_bucket(lengths) is not None
        ):
            logits, greedy, routes = graphs.extend(ids, seq_slots, starts, lengths, lora_slots)
            row_of = {c.last_row: i for i, c in enumerate(chunks) if c.yields}  # a logits row per chunk
            table = None
            if records:
                chunk_places = routes()
                table = torch.cat([chunk_places[i, :length] for i, length in enumerate(lengths)])
        else:
            device = self.device
            batch = ForwardBatch(
                input_ids=ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long, device=device),
                lora_slots=torch.tensor(lora_slots).repeat_interleave(torch.tensor(lengths)).to(device),
                segments=[Segment(*segment) for segment in zip(seq_slots, starts, lengths, strict=True)],
                logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
            )
            routing: list[torch.Tensor] = []
            logits, greedy = greedy_scores(self.model.forward(batch, self.state, self.lora, routing))
            table = self.model.routing_table(routing, len(ids)) if records else None
        for c in chunks:  # copies queued after the forward, so they read the state it leaves
            end = c.start + c.length
            if end in c.seq.snaps:
                self.prefix_cache.insert(c.seq.request.adapter, c.seq.tokens[:end], c.seq.seq_slot)
        tokens = self._draw(chunks, row_of, logits, greedy)
        host_logits = logits.cpu() if any(self._needs_logits(c.seq) for c in chunks) else None
        # int16 holds any expert id; and a copy off the graph's output buffer, which the next step overwrites
        host_routing = table.to(torch.int16) if records else None
        ready = None
        if tokens.is_cuda:  # the tokens come back through pinned memory, so the host need not wait here
            ready = torch.cuda.Event()
            host_tokens = tokens.to("cpu", non_blocking=True)
            if host_routing is not None:
                host_routing = host_routing.to("cpu", non_blocking=True)
            ready.record()
        else:
            host_tokens = tokens.clone()
        return _Launched(chunks, row_of, tokens, host_tokens, ready, host_logits, host_routing)

    def _draw(
        self, chunks: list[_Chunk], row_of: dict[int, int], logits: torch.Tensor, greedy: torch.Tensor
    ) -> torch.Tensor:
        """Each scored row's next token on the device: greedy, or for a sequence that samples, drawn at a uniform
        from its own generator (one uniform per token it yields, so the same uniforms alone or in any batch)."""
        draws = [c for c in chunks if c.yields and not c.seq.request.params.greedy]
        if not draws:
            return greedy
        rows = [row_of[c.last_row] for c in draws]
        params = [c.seq.request.params for c in draws]
        uniforms = [float(torch.rand((), generator=c.seq.generator)) for c in draws]
        packed = torch.tensor(
            [rows, [p.temperature for p in params], [p.top_p for p in params], [p.top_k for p in params], uniforms],
            dtype=torch.float64,
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
        routing = None if launched.routing is None else launched.routing.numpy().astype(self.routing_shape.dtype)
        outputs = []
        for c in launched.chunks:
            seq = c.seq
            if seq not in self.running:
                continue  # ended while this step was queued
            seq.computed = c.start + c.length
            if seq.prompt_logprobs is not None and c.start < seq.num_prompt:
                rows = [row_of[r] for r in range(c.first, c.first + c.length)]
                self._record_prompt_logprobs(seq, launched.logits, rows, c.start)
            if seq.prompt_routing is not None and c.start < seq.num_prompt - 1:
                # positions c.start.. score prompt tokens c.start+1..; the last prompt position scores no prompt token
                scored = min(c.length, seq.num_prompt - 1 - c.start)
                seq.prompt_routing.append(routing[c.first : c.first + scored])
            if seq.computed < len(seq.tokens):
                continue
            if seq.request.params.max_tokens == 0:  # scoring the prompt only
                self._finish(seq)
                outputs.append(self._output(seq, "length"))
                continue
            row = row_of[c.last_row]
            logits = launched.logits[row] if launched.logits is not None else None
            token_routing = None if routing is None else routing[c.last_row : c.last_row + 1]
            out = self._advance(seq, int(launched.host_tokens[row]), logits, token_routing)
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

    def _advance(
        self, seq: _Sequence, token: int, logits: torch.Tensor | None, routing: np.ndarray | None
    ) -> StepOutput | None:
        """Append the sequence's next token (its logprobs from the host `logits` and its `routing` [1, MoE layers,
        top_k] where the request asks)."""
        params = seq.request.params
        if params.logprobs is not None:
            chosen, top = token_logprobs(torch.log_softmax(logits, dim=-1), token, params.logprobs)
            seq.pending_logprobs.append(TokenLogprob(token, chosen, top))
        if params.return_routing:
            seq.pending_routing.append(routing)
        seq.tokens.append(token)
        seq.pending.append(token)
        seq.text_delta, reason = seq.finisher.advance(seq.generated)
        if reason is not None:
            self._finish(seq)
            return self._output(seq, reason)
        if not seq.text_delta and params.logprobs is None:
            return None  # nothing final to show yet (held back); the tokens go out with the next output
        return self._output(seq, None)

    def _output(self, seq: _Sequence, reason: str | None) -> StepOutput:
        text, seq.text_delta = seq.text_delta, ""
        empty = self.routing_shape.empty()
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
            routing=np.concatenate([empty, *seq.pending_routing]) if seq.request.params.return_routing else None,
            prompt_routing=None if seq.prompt_routing is None else np.concatenate([empty, *seq.prompt_routing]),
        )
        seq.pending, seq.pending_logprobs, seq.prompt_logprobs = [], [], None
        seq.pending_routing, seq.prompt_routing = [], None
        return out

    # ---- convenience -------------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> dict[str, list[Choice]]:
        """Add `requests`, step until all finish, and gather each request's choices (by index)."""
        return generate(self, requests)
