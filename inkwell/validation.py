"""How a pydantic ValidationError is told to a user, in one wording for the API, the SDK and the CLIs: where the
value is wrong, as dotted names, and what is wrong, without the "Value error, " pydantic puts before a validator's
own message ("name: Value error, it contains a path separator")."""

from collections.abc import Mapping
from typing import Any

import pydantic


def place(error: Mapping[str, Any], *under: str) -> str:
    """The error's location as dotted names below `under` ('' when it is the whole value)."""
    return ".".join(str(part) for part in (*under, *error.get("loc", ())))


def reason(error: Mapping[str, Any]) -> str:
    """What is wrong: a validator's own message as it wrote it, pydantic's messages as they are."""
    return str(error.get("msg", "")).removeprefix("Value error, ")


def first_error(exc: pydantic.ValidationError, *under: str) -> tuple[str, str]:
    """(place, reason) of the first error."""
    error = exc.errors()[0]
    return place(error, *under), reason(error)
