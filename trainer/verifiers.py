"""Built-in verifiers: the reward of a completion against a problem's answer, chosen by name.

RL scores completions with these (the RL recipe on the client today, an RL job on the service later), so naming
one is all a run needs and no user code runs on the server. Each maps (the completion's text, the dataset's
answer) to a reward in [0, 1].
"""

import re
from collections.abc import Callable

type RewardFn = Callable[[str, str], float]  # (the completion's text, the problem's answer) -> reward


def exact_match(completion: str, answer: str) -> float:
    """1 when the completion is the answer (surrounding whitespace aside), else 0."""
    return float(completion.strip() == answer.strip())


def regex(completion: str, answer: str) -> float:
    """1 when the whole completion (surrounding whitespace aside) matches the answer as a regular expression."""
    return float(re.fullmatch(answer, completion.strip()) is not None)


VERIFIERS: dict[str, RewardFn] = {"exact_match": exact_match, "regex": regex}


def verifier(name: str) -> RewardFn:
    """The built-in verifier called `name`."""
    try:
        return VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; built in: {', '.join(VERIFIERS)}") from None
