"""Serving-tier configuration from the environment (prefix INKWELL_SERVING_)."""

import torch
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from inkwell.serving.contract import EngineConfig


class ServingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INKWELL_SERVING_", extra="ignore")

    engine: str = Field("native", description="engine kind (a key of inkwell.serving.contract.ENGINES)")
    devices: list[str] | None = Field(
        None,
        description="one worker per device (its first one when a worker spans several); default: every GPU, else the "
        "CPU",
    )
    tensor_parallel: int = Field(1, ge=1, description="native engine: devices a worker splits attention heads over")
    expert_parallel: int = Field(1, ge=1, description="native engine: devices a worker splits the experts over")
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
        EngineConfig.prefix_cache_bytes, ge=0, description="device memory the prefix cache may hold, per device"
    )
    max_inflight_per_worker: int = Field(64, ge=1, description="beyond this on every worker: 429")
    start_timeout: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _split_engine(self) -> "ServingSettings":
        if self.devices_per_worker > 1 and self.engine != "native":
            raise ValueError("tensor_parallel and expert_parallel split the native engine; use engine=native")
        return self

    @property
    def devices_per_worker(self) -> int:
        """The devices (one process each) one worker's engine spans: tensor_parallel x expert_parallel."""
        return self.tensor_parallel * self.expert_parallel

    def worker_devices(self) -> list[str]:
        """Each worker's device, or with several devices per worker its first one (its ranks take the next ones:
        GPUs in whole groups, cuda:0, cuda:N, ...; on the CPU every rank is a process on the CPU)."""
        if self.devices:
            return list(self.devices)
        span = self.devices_per_worker
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            if count < span:
                raise ValueError(f"a worker spans {span} devices (tensor_parallel x expert_parallel); {count} GPUs")
            return [f"cuda:{i}" for i in range(0, count - span + 1, span)]
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
            cuda_graphs=self.devices_per_worker == 1,  # a decode graph would have to capture the collectives
            tensor_parallel=self.tensor_parallel,
            expert_parallel=self.expert_parallel,
            dtype=dtype,
            device=device,
        )
