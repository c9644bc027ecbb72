"""Serving-tier configuration from the environment (prefix INKWELL_SERVING_)."""

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from inkwell.serving.contract import EngineConfig


class ServingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INKWELL_SERVING_", extra="ignore")

    engine: str = Field("native", description="engine kind (a key of inkwell.serving.contract.ENGINES)")
    devices: list[str] | None = Field(None, description="one worker per device; default: every GPU, else the CPU")
    dtype: str = Field("auto", description="float32 | bfloat16 | auto (bfloat16 on GPUs, float32 on the CPU)")
    threads: int = Field(1, ge=1, description="torch threads per CPU worker")
    max_loras_per_batch: int = Field(4, ge=1)
    max_lora_rank: int = Field(64, ge=1)
    max_loaded_adapters: int = Field(16, ge=1)
    max_seqs: int = Field(16, ge=1, description="sequences decoding at once per worker")
    max_batch_tokens: int = Field(256, ge=1, description="tokens per engine step (prefill is chunked to fit)")
    max_context: int | None = Field(None, ge=2)
    prefix_cache: bool = Field(EngineConfig.prefix_cache, description="native engine: reuse computed prompt prefixes")
    prefix_cache_bytes: int = Field(
        EngineConfig.prefix_cache_bytes, ge=0, description="device memory the prefix cache may hold, per worker"
    )
    max_inflight_per_worker: int = Field(64, ge=1, description="beyond this on every worker: 429")
    start_timeout: float = Field(300.0, gt=0)

    def worker_devices(self) -> list[str]:
        if self.devices:
            return list(self.devices)
        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return ["cpu"]

    def engine_config(self, device: str) -> EngineConfig:
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        return EngineConfig(
            max_loras_per_batch=self.max_loras_per_batch,
            max_lora_rank=self.max_lora_rank,
            max_loaded_adapters=self.max_loaded_adapters,
            max_seqs=self.max_seqs,
            max_batch_tokens=self.max_batch_tokens,
            max_context=self.max_context,
            prefix_cache=self.prefix_cache,
            prefix_cache_bytes=self.prefix_cache_bytes,
            dtype=dtype,
            device=device,
        )
