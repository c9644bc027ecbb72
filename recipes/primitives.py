"""What the RL loop (`inkwell.recipes.rl`) asks of a training session and its sampler, as protocols.

The SDK's `TrainingSession` and `SamplingClient` answer them over HTTP; `inkwell.recipes.local` answers them in one
process (a training core and a native engine side by side, as an RL job runs). One loop, either set of primitives.
Every call returns something whose `result(timeout)` is its value, as the SDK's futures do.
"""

from collections.abc import Iterable, Mapping
from typing import Any, Protocol


class Future[T](Protocol):
    def result(self, timeout: float | None = None) -> T: ...


class Weights(Protocol):
    """Published sampler weights: the optimizer step they were taken after."""

    @property
    def step(self) -> int: ...


class Sampler(Protocol):
    def sample(self, prompt_tokens: Iterable[int], num_samples: int = 1, **params: Any) -> Future[Mapping[str, Any]]:
        """`num_samples` completions (params: max_tokens, temperature, seed, return_routing, prompt_routing); the
        value's `sequences` each have `tokens`, the sampler's `logprobs` of them and (return_routing) their
        `routing` trace, and (prompt_routing) the value's `prompt_routing` is the prompt's, None first."""
        ...


class Session(Protocol):
    def forward_backward(
        self, data: Iterable[Mapping[str, Any]], loss_fn: str = ..., loss_fn_config: Mapping[str, float] | None = ...
    ) -> Future[Mapping[str, Any]]:
        """Accumulate the loss's gradients over the datums; the value has `metrics`."""
        ...

    def optim_step(self, params: Any = ..., **overrides: Any) -> Future[Mapping[str, Any]]: ...

    def save_state(self, name: str) -> Future[Mapping[str, Any]]:
        """The value's `state` names the saved state for `load_state`."""
        ...

    def load_state(self, state: str, with_optimizer: bool = ...) -> Future[Mapping[str, Any]]: ...

    def save_weights_for_sampler(self, name: str | None = ...) -> Future[Weights]: ...

    def sampling_client(self, weights: Any) -> Sampler: ...
