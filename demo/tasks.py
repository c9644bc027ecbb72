"""The demo's two small tasks, generated deterministically, with exact-match scoring.

Both are short classification-style completions a tiny randomly initialised Inkling can learn
with LoRA in a few minutes on two CPU cores; each adapter learns one, so the table shows the
adapter chosen per request doing its own task and not the other.
"""

import random
import re
from dataclasses import dataclass

POSITIVE = [
    "great",
    "lovely",
    "excellent",
    "wonderful",
    "superb",
    "delightful",
    "perfect",
    "fantastic",
    "amazing",
    "charming",
    "brilliant",
    "pleasant",
]
NEGATIVE = [
    "awful",
    "terrible",
    "horrible",
    "dreadful",
    "bland",
    "rude",
    "broken",
    "disappointing",
    "boring",
    "dirty",
    "annoying",
    "mediocre",
]
SUBJECTS = [
    "the food",
    "the service",
    "the room",
    "the movie",
    "the book",
    "the staff",
    "the coffee",
    "the trip",
    "the music",
    "the view",
    "the game",
    "the show",
    "the hotel",
    "the pizza",
    "the concert",
    "the car",
    "the phone",
    "the class",
    "the beach",
    "the museum",
]
VERBS = ["was", "is", "felt", "seemed"]


@dataclass(frozen=True)
class Example:
    prompt: str
    completion: str


def sentiment_example(rng: random.Random) -> Example:
    label = rng.choice(["positive", "negative"])
    word = rng.choice(POSITIVE if label == "positive" else NEGATIVE)
    return Example(f"Review: {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {word}.\nSentiment:", f" {label}")


def parity_example(rng: random.Random) -> Example:
    n = rng.randrange(10, 100000)
    return Example(f"Number: {n}\nParity:", " even" if n % 2 == 0 else " odd")


TASKS = {"sentiment": sentiment_example, "parity": parity_example}


def make_split(task: str, n: int, seed: int, exclude: set[str] = frozenset()) -> list[Example]:
    """`n` distinct examples of `task`, none of whose prompts is in `exclude` (held-out splits)."""
    rng = random.Random(seed)
    seen: set[str] = set(exclude)
    out: list[Example] = []
    for _ in range(100 * n):
        if len(out) == n:
            break
        ex = TASKS[task](rng)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
    if len(out) < n:
        raise ValueError(f"task {task!r} has fewer than {n} distinct prompts")
    return out


def is_correct(example: Example, generated: str) -> bool:
    """Exact match of the first word of the generation with the expected label."""
    match = re.match(r"\s*([A-Za-z]+)", generated)
    return match is not None and match.group(1) == example.completion.strip()
