"""Where the loader gets an adapter version from: a local directory, the registry's S3 objects, or memory.

Sources are small picklable descriptions, so the service can hand one to a loader process that
opens its own S3 connection. A directory or S3 source ends as a local adapter directory that
`inkwell.adapters.io.load_adapter` verifies against its manifest (sha256 of every file); a memory source is a
training session's adapter handed over in shared memory, which never touches disk or S3 on its way.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.io import load_adapter


class SourceError(RuntimeError):
    """An adapter's files could not be fetched intact."""


@dataclass(frozen=True)
class DirectorySource:
    path: str

    def load(self, scratch: Path, config: InklingTextConfig) -> Adapter:
        return load_adapter(self.fetch(scratch), config)

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

    def load(self, scratch: Path, config: InklingTextConfig) -> Adapter:
        return load_adapter(self.fetch(scratch), config)

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


@dataclass(frozen=True)
class MemorySource:
    """An adapter in memory: its tensors travel to the loader as shared memory (CUDA IPC handles for GPU
    tensors), pickled by torch.multiprocessing."""

    adapter: Adapter

    def load(self, scratch: Path, config: InklingTextConfig) -> Adapter:
        return self.adapter


AdapterSource = DirectorySource | S3Source | MemorySource
