"""The native Inkling engine: continuous batching with a LoRA adapter per request (CPU or one GPU)."""

from inkwell.service.engine.engine import (
    Choice,
    Engine,
    EngineConfig,
    EngineError,
    Request,
    StepOutput,
    TokenLogprob,
)
from inkwell.service.engine.interface import ENGINES, ServingEngine, make_engine
from inkwell.service.engine.lora import AdapterIncompatibleError, NoFreeSlotError
from inkwell.service.engine.sampling import SamplingError, SamplingParams

__all__ = [
    "ENGINES",
    "AdapterIncompatibleError",
    "Choice",
    "Engine",
    "EngineConfig",
    "EngineError",
    "NoFreeSlotError",
    "Request",
    "SamplingError",
    "SamplingParams",
    "ServingEngine",
    "StepOutput",
    "TokenLogprob",
    "make_engine",
]
