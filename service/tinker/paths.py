"""`tinker://<run>/<kind>/<name>` paths, as the client parses them (exactly three segments).

A run is a training session: its id is the inkwell session id, which names the session's saved states in the
object store. `weights/<name>` is the saved state `<run>/<name>` (`SessionManager.save_state`);
`sampler_weights/<name>` is the registry version of the run's adapter that the alias `tinker-<name>` points at
(registry aliases cannot be all digits, and the cookbook names its checkpoints `000020`); `external_weights/<name>`
is the adapter exported in the `peft` layout (`SessionManager.save_external`), to be downloaded and run elsewhere.
"""

from dataclasses import dataclass
from typing import Literal

from inkwell.service.errors import APIError
from inkwell.trainer.config import name_problem

SCHEME = "tinker://"
SAMPLER_ALIAS_PREFIX = "tinker-"
Kind = Literal["weights", "sampler_weights", "external_weights"]
CHECKPOINT_TYPES: dict[str, str] = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def check_name(name: str | None, what: str) -> str:
    """A checkpoint name that can be a state name and, prefixed, a registry alias; 400 naming the rule if not."""
    if not name:
        raise APIError(400, "invalid_name", f"{what}: a checkpoint name is required")
    problem = name_problem(SAMPLER_ALIAS_PREFIX + name)
    if problem:
        raise APIError(400, "invalid_name", f"{what}: {name!r} cannot name a checkpoint: {problem}", field=what)
    return name


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    kind: Kind
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def state_ref(self) -> str:
        """The saved state's reference for `SessionManager` ('<session id>/<name>')."""
        return f"{self.run_id}/{self.name}"

    @property
    def alias(self) -> str:
        return SAMPLER_ALIAS_PREFIX + self.name

    @classmethod
    def parse(cls, path: str, field: str = "path") -> "TinkerPath":
        parts = path.removeprefix(SCHEME).split("/") if path.startswith(SCHEME) else []
        if len(parts) != 3 or parts[1] not in CHECKPOINT_TYPES or not parts[0] or not parts[2]:
            raise APIError(
                400,
                "invalid_path",
                f"{field}: {path!r} is not a checkpoint path; inkwell's are tinker://<run>/weights/<name> "
                "(saved states), tinker://<run>/sampler_weights/<name> (sampler weights) and "
                "tinker://<run>/external_weights/<name> (exported adapters)",
                field=field,
            )
        return cls(parts[0], parts[1], check_name(parts[2], field))  # type: ignore[arg-type]

    @classmethod
    def of_checkpoint(cls, run_id: str, checkpoint_id: str) -> "TinkerPath":
        return cls.parse(f"{SCHEME}{run_id}/{checkpoint_id}", "checkpoint_id")


def sampler_name(alias: str) -> str | None:
    """The checkpoint name behind a registry alias set by a named save_weights_for_sampler, else None."""
    return alias.removeprefix(SAMPLER_ALIAS_PREFIX) if alias.startswith(SAMPLER_ALIAS_PREFIX) else None
