"""Where the loader fetches an adapter version from: a local directory or the registry's S3 objects.

Sources are small picklable descriptions, so the service can hand one to a loader process that
opens its own S3 connection. Every source ends as a local adapter directory that
`inkwell.adapters.io.load_adapter` verifies against its manifest (sha256 of every file).
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path


class SourceError(RuntimeError):
    """An adapter's files could not be fetched intact."""


@dataclass(frozen=True)
class DirectorySource:
    path: str

    def fetch(self, scratch: Path) -> Path:
        directory = Path(self.path)
        if not directory.is_dir():
            raise SourceError(f"adapter directory {directory} does not exist")
        return directory


@dataclass(frozen=True)
class S3Source:
    """The files of one layout of one registry version: `prefix + path` for each (path, sha256)."""

    endpoint: str | None
    bucket: str
    prefix: str
    files: tuple[tuple[str, str], ...]
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = None

    def fetch(self, scratch: Path) -> Path:
        from inkwell.service.storage import ObjectStore  # boto3 only where S3 is used (not on a GPU box)

        store = ObjectStore(self.endpoint, self.bucket, self.region, self.access_key, self.secret_key)
        directory = scratch / hashlib.sha256(self.prefix.encode()).hexdigest()[:16]
        for path, sha256 in self.files:
            target = directory / path
            store.download_file(self.prefix + path, target)
            digest = hashlib.sha256(target.read_bytes()).hexdigest()
            if digest != sha256:
                raise SourceError(
                    f"{self.prefix}{path}: sha256 {digest[:12]} differs from the registry's {sha256[:12]}"
                )
        return directory


AdapterSource = DirectorySource | S3Source
