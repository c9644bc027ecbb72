"""The verifiable tasks bundled with the recipes (`data/<name>.jsonl`), each with the verifier and the settings
it was tuned with, so the demo, the tests and a user run the same thing.

`letter-case`: "One letter in the case of HOUSE:" is answered by any capital letter and "... of house:" by any
small one, in one token (the `regex` verifier against `[A-Z]` or `[a-z]`). inkling-tiny is randomly initialised:
its first answers spread over all 384 token ids and about one in fifteen is a letter of the right case. GRPO
finds the letters first (reward near 0.5: any letter, either case) and then, more slowly, the word's case (near 1).
With inkling-tiny as transformers 5.19 initialises it (seed 0), 16 prompts x 8 samples per step on two CPU cores: at
learning rate 2e-2 the reward goes from 0.08 (first 3 steps) to 0.5 by step 8 and holds 0.4-0.7 (last 10 steps:
0.51); at 1e-2 it rose only after step 22 (last 10: 0.38), too late for a 30-step run. The rate is high, and a run
can fall back after it has learned: over seeds 0-17 (the recipe's loop in process, fp32, 15 steps, 2026-12-05), 4
runs dropped below 0.1 for one to five steps after reaching 0.3 (the lm_head's LoRA is the only target this random
model learns through: without it the reward stays near 0.08), 17 reached a 3-step mean 0.3 above their first 3 steps'
and one (seed 10, which fell at step 9) only past step 14. Neither Adam's beta2 0.999, its eps 1e-8 or 1e-6, nor
normalised advantages stopped the falls; a linear decay of the rate (3e-2 to 0) made them rarer but the rise slower.
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
