"""The request-building layer shared by `Client` and `AsyncClient`.

An API operation is a `Call` (one HTTP request plus how to read its answer) or an `Op`: a
generator that yields Calls, receives each parsed result and returns the operation's value.
Operations never do I/O themselves, so the same code runs under the sync and the async
transport; only the transports (transport.py) touch the network.
"""

import hashlib
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from inkwell.sdk.errors import IntegrityError

type Op[T] = Generator[Call, Any, T]

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})


@dataclass(frozen=True)
class Upload:
    """One multipart file part; a Path is reopened on every attempt so retries resend it whole."""

    field: str
    filename: str
    source: bytes | Path
    content_type: str = "application/octet-stream"


@dataclass
class Call:
    """One HTTP request. `path` is relative to the service URL, or an absolute URL (presigned S3)."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    data: dict[str, str] | None = None
    uploads: list[Upload] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    parse: Callable[[httpx.Response], Any] = lambda response: None
    sink: "FileSink | None" = None
    auth: bool = True
    timeout: httpx.Timeout | None = None
    max_retries: int | None = None  # None: the client's

    @property
    def idempotent(self) -> bool:
        return self.method in IDEMPOTENT_METHODS

    @property
    def clean_params(self) -> dict[str, Any] | None:
        """Query parameters without the Nones (an unset filter is not sent at all)."""
        if not self.params:
            return None
        return {k: v for k, v in self.params.items() if v is not None}


def single[T](call: Call) -> Op[T]:
    """The Op of one Call (its parsed answer): for an operation whose arguments are checked before it is run."""
    return (yield call)


def segment(value: str | int) -> str:
    """One URL path segment, percent-encoded so a stray '/' cannot reach another route."""
    return quote(str(value), safe="")


def parse_model[T](model: type[T]) -> Callable[[httpx.Response], T]:
    return lambda response: model.model_validate_json(response.content)  # type: ignore[attr-defined]


class FileSink:
    """Streams a download into `<dest>.part`, hashing as it goes; `finish` keeps it only if the sha256
    matches both the registry's record and the server's `X-Inkwell-SHA256` header."""

    def __init__(self, dest: Path, sha256: str, size: int | None = None) -> None:
        self.dest = dest
        self.part = dest.with_name(f".{dest.name}.part")
        self.expected = sha256.lower()
        self.size = size
        self._hash = hashlib.sha256()
        self._file = None
        self._written = 0

    def open(self) -> None:
        """(Re)start the file: called at the start of every attempt."""
        self.close()
        self._hash = hashlib.sha256()
        self._written = 0
        self._file = self.part.open("wb")

    def write(self, chunk: bytes) -> None:
        self._hash.update(chunk)
        self._written += len(chunk)
        self._file.write(chunk)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self, headers: httpx.Headers) -> Path:
        """Verify the bytes and return the `.part` path; a mismatch deletes the file and raises."""
        self.close()
        got = self._hash.hexdigest()
        header = headers.get("x-inkwell-sha256", "").lower()
        problems = []
        if got != self.expected:
            problems.append(f"sha256 {got} != recorded {self.expected}")
        if header and header != got:
            problems.append(f"sha256 {got} != X-Inkwell-SHA256 {header}")
        if self.size is not None and self._written != self.size:
            problems.append(f"{self._written} bytes != recorded size {self.size}")
        if problems:
            self.discard()
            raise IntegrityError(
                f"download of {self.dest.name} is corrupt ({'; '.join(problems)}); nothing was kept, retry it",
                code="checksum_mismatch",
                details={"file": self.dest.name, "sha256": got, "expected": self.expected, "retryable": True},
            )
        return self.part

    def commit(self) -> None:
        os.replace(self.part, self.dest)

    def discard(self) -> None:
        self.close()
        self.part.unlink(missing_ok=True)
