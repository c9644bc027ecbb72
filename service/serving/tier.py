"""The serving tier as the service holds it: resolver, router and per-base tokenizers and limits."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from inkwell.models import load_base_config, load_tokenizer
from inkwell.service.serving.resolve import ModelName, ModelResolver, ResolvedModel
from inkwell.service.serving.router import ServingRouter
from inkwell.service.serving.settings import ServingSettings
from inkwell.service.serving.worker import WorkerConfig, WorkerHandle


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

    def tokenizer(self, model_dir: Path) -> PreTrainedTokenizerFast:
        return _tokenizer(str(model_dir))

    def max_context(self, model_dir: Path) -> int:
        limit = _config(str(model_dir)).max_position_embeddings
        return min(limit, self.settings.max_context or limit)

    def close(self) -> None:
        self.router.close()


@cache
def _tokenizer(model_dir: str) -> PreTrainedTokenizerFast:
    return load_tokenizer(model_dir)


@cache
def _config(model_dir: str):
    return load_base_config(model_dir)
