"""What megatron-core 0.19.2 needs to run on a CPU-only host, in one place, applied idempotently.

megatron-core assumes CUDA for its RNG tracker (it saves and restores `torch.cuda` generator
states around every fork). On a host without CUDA the tracker keeps CPU generator states
instead, so dropout inside `get_cuda_rng_tracker().fork()` stays reproducible and
TP-consistent exactly as on GPUs. The tensor-parallel layers, mappings and vocab-parallel
cross entropy we use need nothing else when built with `use_cpu_initialization=True`.
"""

import torch
from megatron.core.tensor_parallel import random as mcore_random

_APPLIED = False


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron's tracker with its named states kept as CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)


def apply() -> None:
    """Route megatron's CUDA RNG bookkeeping to the CPU generator when CUDA is absent."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _APPLIED = True
