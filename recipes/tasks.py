"""The verifiable tasks bundled with the recipes (`data/<name>.jsonl`), each with the verifier and the settings
it was tuned with, so the demo, the tests and a user run the same thing.

`letter-case`: "One letter in the case of HOUSE:" is answered by any capital letter and "... of house:" by any
small one, in one token (the `regex` verifier against `[A-Z]` or `[a-z]`). inkling-tiny is randomly initialised:
its first answers spread over all 384 token ids and about one in fifteen is a letter of the right case. GRPO
finds the letters first (reward near 0.5: any letter, either case) and then, more slowly, the word's case (near 1).
With inkling-tiny as transformers 5.19 initialises it (seed 0), 16 prompts x 8 samples per step on two CPU cores: at
learning rate 2e-2 the reward goes from 0.08 (first 3 steps) to 0.5 by step 8 and holds 0.4-0.7 (last 10 steps:
0.51); at 1e-2 it rose only after step 22 (last 10: 0.38), too late for a 30-step run.
"""

from dataclasses import dataclass
from pathlib import Path

from inkwell.adapters.spec import LoraSpec  # the SDK's own (inkwell.sdk.LoraSpec), without the HTTP client
from inkwell.recipes.problems import Problem, load_problems
from inkwell.recipes.rl import RLConfig

DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class BundledTask:
    name: str
    verifier: str  # a name in inkwell.trainer.verifiers.VERIFIERS
    lora: LoraSpec
    config: RLConfig

    def problems(self) -> list[Problem]:
        return load_problems(DATA / f"{self.name}.jsonl")


TASKS: dict[str, BundledTask] = {
    task.name: task
    for task in (
        BundledTask(
            "letter-case",
            "regex",
            LoraSpec(rank=8, alpha=16, targets=("attn", "mlp", "experts", "shared_experts", "lm_head")),
            RLConfig(steps=30, prompts_per_step=16, group_size=8, max_tokens=1, learning_rate=2e-2),
        ),
    )
}
