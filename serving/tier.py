"""The serving tier as the service holds it: the one interface between the web app and the workers.

The service resolves a request's model, tokenizes for its base, checks the request against that base's
limits and submits it; everything behind `submit` (workers per device, adapter loads, routing, the engines)
is the tier's own.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import cache

from transformers import PreTrainedTokenizerFast

from inkwell.models import load_base_config, load_tokenizer
from inkwell.serving.contract import EngineError, PrefixCacheStats, SamplingParams
from inkwell.serving.handle import RequestStream, WorkerHandle
from inkwell.serving.resolve import ModelName, ModelResolver, ResolvedModel
from inkwell.serving.router import AdapterRef, ServingRouter
from inkwell.serving.rules import check_prompt, check_routing, context_limit
from inkwell.serving.settings import ServingSettings
from inkwell.serving.worker import WorkerConfig


class ServingTier:
    """Resolve a request's model, tokenize for its base, and route it to a worker."""

    def __init__(self, resolver: ModelResolver, settings: ServingSettings | None = None):
        self.resolver = resolver
        self.settings = settings or ServingSettings()
        self.router = ServingRouter(self._start_workers, self.settings.max_inflight_per_worker)

    def _start_workers(self, base: str) -> list[WorkerHandle]:
        """One worker per device for `base`, started in parallel; all or none."""
        model_dir = self.resolver.base_dir(base)
        handles = [
            WorkerHandle(
                WorkerConfig(
                    model_dir=str(model_dir),
                    engine=self.settings.engine_config(device),
                    threads=self.settings.threads,
                    name=f"{base}-{i}",
                    engine_kind=self.settings.engine,
                )
            )
            for i, device in enumerate(self.settings.worker_devices())
        ]
        try:
            with ThreadPoolExecutor(len(handles)) as pool:
                list(pool.map(lambda h: h.start(self.settings.start_timeout), handles))
        except BaseException:
            for handle in handles:
                handle.close()
            raise
        return handles

    async def resolve(self, tenant_id: str, model: str) -> ResolvedModel:
        return await asyncio.to_thread(self.resolver.resolve, tenant_id, ModelName.parse(model))

    def tokenizer(self, resolved: ResolvedModel) -> PreTrainedTokenizerFast:
        return _tokenizer(str(resolved.model_dir))

    def check(self, resolved: ResolvedModel, prompt_ids: list[int], params: SamplingParams) -> None:
        """EngineError where the workers would refuse the request (sampling, prompt, context, routing): raised here, a
        bad request gets its answer before any stream starts."""
        config = _config(str(resolved.model_dir))
        # the model's own ids, as the engines and the trainer take them: its vocabulary may be padded past the
        # tokenizer's (inkling-tiny: 384 ids, 263 with text), and a sequence it sampled can always be sent back
        check_prompt(prompt_ids, params, config.vocab_size, context_limit(config, self.settings.max_context))
        check_routing(params, self.settings.engine)

    def check_fits(self, prompts: int) -> None:
        """EngineError when a request's prompts can never be in flight together: each prompt is one request on a
        worker and the router holds at most `max_inflight_per_worker` per worker, so a request of more prompts
        than all the workers hold would be refused as busy (429) forever; this says what fits."""
        workers = len(self.settings.worker_devices())
        per_worker = self.settings.max_inflight_per_worker
        if prompts > workers * per_worker:
            raise EngineError(
                "too_many_prompts",
                f"the request has {prompts} prompts and at most {workers * per_worker} fit in flight at once "
                f"({per_worker} per worker on {workers} worker{'s' if workers > 1 else ''}; each prompt with its n "
                "choices is one request): send them in several requests",
                "prompt",
            )

    async def submit(self, resolved: ResolvedModel, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Start one request on a worker of its base (loading its adapter there first); iterate for outputs."""
        return await self.router.submit(resolved.base, prompt_ids, params, resolved.adapter)

    async def preload(self, base: str, adapter: AdapterRef) -> None:
        """Put an adapter on the workers of `base` before any request names it (a training session's sampler
        weights: the adapter only, in memory, not through the object store)."""
        await self.router.preload(base, adapter)

    def fleet(self) -> dict[str, list[WorkerHandle]]:
        """Each base model's workers, for the status route (the service reads their state, never drives them)."""
        return self.router.fleet()

    def cache_stats(self) -> dict[str, PrefixCacheStats]:
        """Each running worker's prefix cache counters as it last reported them, by worker name (for /metrics)."""
        workers = (w for ws in list(self.router.workers.values()) for w in ws)
        return {w.config.name: w.cache_stats for w in workers if w.alive and w.cache_stats is not None}

    def close(self) -> None:
        self.router.close()


@cache
def _tokenizer(model_dir: str) -> PreTrainedTokenizerFast:
    return load_tokenizer(model_dir)


@cache
def _config(model_dir: str):
    return load_base_config(model_dir)
