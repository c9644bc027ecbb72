"""boto3 against any S3 endpoint, with the errors the service cares about made explicit.

Writes are create-only (`If-None-Match: *`) and carry a SHA-256 checksum the server verifies,
so an object, once written, is exactly the bytes we hashed and is never overwritten.
"""

import base64
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

CHUNK = 1 << 20


class StorageUnavailable(RuntimeError):
    """The S3 endpoint cannot be reached or failed on its side; retrying later can succeed."""


class ObjectExists(RuntimeError):
    """A create-only write found the key taken."""


class ObjectMissing(KeyError):
    """No object under that key."""


class ObjectCorrupt(RuntimeError):
    """An object's bytes are not the ones recorded for it (size or sha256): damaged at rest, not retryable."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: datetime


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _b64(hexdigest: str) -> str:
    return base64.b64encode(bytes.fromhex(hexdigest)).decode()


class ObjectStore:
    """One bucket on one S3 endpoint."""

    def __init__(
        self,
        endpoint: str | None,
        bucket: str,
        region: str = "us-east-1",
        access_key: str | None = None,
        secret_key: str | None = None,
        connect_timeout: float = 2.0,
        read_timeout: float = 30.0,
    ) -> None:
        self.bucket = bucket
        self.endpoint = endpoint
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": 2, "mode": "standard"},
            s3={"addressing_style": "path"},
            max_pool_connections=64,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            aws_access_key_id=access_key or "inkwell",
            aws_secret_access_key=secret_key or "inkwell",
            config=config,
        )

    def _call(self, fn, **kwargs):
        try:
            return fn(**kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                raise ObjectExists(kwargs.get("Key", "")) from exc
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                raise ObjectMissing(kwargs.get("Key", "")) from exc
            if status >= 500 or status == 0:
                raise StorageUnavailable(f"S3 {code or status}: {exc}") from exc
            raise
        except BotoCoreError as exc:
            raise StorageUnavailable(f"S3 endpoint {self.endpoint} unreachable: {exc}") from exc

    def ensure_bucket(self) -> None:
        try:
            self._call(self.client.head_bucket, Bucket=self.bucket)
        except ObjectMissing:
            self._call(self.client.create_bucket, Bucket=self.bucket)

    def ping(self) -> bool:
        try:
            self._call(self.client.head_bucket, Bucket=self.bucket)
            return True
        except (StorageUnavailable, ObjectMissing, ClientError):
            return False

    def put_bytes(self, key: str, data: bytes, create_only: bool = True) -> str:
        """Store `data`; returns its sha256. ObjectExists if create_only and the key is taken."""
        digest = hashlib.sha256(data).hexdigest()
        extra = {"IfNoneMatch": "*"} if create_only else {}
        self._call(self.client.put_object, Bucket=self.bucket, Key=key, Body=data, ChecksumSHA256=_b64(digest), **extra)
        return digest

    def put_file(self, key: str, path: Path, create_only: bool = True) -> tuple[str, int]:
        """Store a local file; returns (sha256, size)."""
        digest = sha256_file(path)
        extra = {"IfNoneMatch": "*"} if create_only else {}
        with open(path, "rb") as f:
            self._call(
                self.client.put_object, Bucket=self.bucket, Key=key, Body=f, ChecksumSHA256=_b64(digest), **extra
            )
        return digest, path.stat().st_size

    def get_bytes(self, key: str) -> bytes:
        body = self._call(self.client.get_object, Bucket=self.bucket, Key=key)["Body"]
        try:
            return body.read()
        except BotoCoreError as exc:
            raise StorageUnavailable(f"reading {key}: {exc}") from exc

    def open_stream(self, key: str) -> tuple[int, Iterator[bytes]]:
        """(size, chunks) of an object; the GET is issued now so errors surface before streaming."""
        resp = self._call(self.client.get_object, Bucket=self.bucket, Key=key)
        body = resp["Body"]

        def chunks() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(CHUNK)
            finally:
                body.close()

        return resp["ContentLength"], chunks()

    def _get(self, key: str, size: int):
        resp = self._call(self.client.get_object, Bucket=self.bucket, Key=key)
        if resp["ContentLength"] != size:
            resp["Body"].close()
            raise ObjectCorrupt(f"{key}: {resp['ContentLength']} bytes stored, {size} recorded")
        return resp["Body"]

    def get_verified(self, key: str, sha256: str, size: int) -> bytes:
        """The object's bytes, read whole and checked against the recorded `size` and `sha256` (ObjectCorrupt)."""
        body = self._get(key, size)
        try:
            data = body.read()
        except BotoCoreError as exc:
            raise StorageUnavailable(f"reading {key}: {exc}") from exc
        finally:
            body.close()
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            raise ObjectCorrupt(f"{key}: stored bytes do not match the recorded sha256")
        return data

    def open_verified_stream(self, key: str, sha256: str, size: int) -> Iterator[bytes]:
        """Chunks of an object too big to read whole, checked against `sha256` as they pass.

        The last chunk is held back until the digest matched, so a damaged object ends short of its
        Content-Length (the connection is cut) and no client can take it for a complete body. A wrong size
        is ObjectCorrupt at once, before anything is sent.
        """
        body = self._get(key, size)

        def held_back() -> Iterator[bytes]:
            digest, pending = hashlib.sha256(), None
            try:
                for chunk in body.iter_chunks(CHUNK):
                    digest.update(chunk)
                    if pending is not None:
                        yield pending
                    pending = chunk
                if digest.hexdigest() != sha256:
                    raise ObjectCorrupt(f"{key}: stored bytes do not match the recorded sha256")
                if pending is not None:
                    yield pending
            finally:
                body.close()

        return held_back()

    def download_file(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        size, chunks = self.open_stream(key)
        with open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)

    def put_tree(self, prefix: str, root: Path) -> list[str]:
        """Store every file under `root` at `prefix` + its relative path (overwriting); returns the keys."""
        keys = []
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            keys.append(prefix + file.relative_to(root).as_posix())
            self.put_file(keys[-1], file, create_only=False)
        return keys

    def download_tree(self, prefix: str, root: Path) -> int:
        """Download every object under `prefix` into `root` (the rest of each key as its path); returns the count."""
        objects = self.list_objects(prefix)
        for obj in objects:
            self.download_file(obj.key, root / obj.key[len(prefix) :])
        return len(objects)

    def list_objects(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        token: str | None = None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            resp = self._call(self.client.list_objects_v2, **kwargs)
            out += [ObjectInfo(o["Key"], o["Size"], o["LastModified"]) for o in resp.get("Contents", [])]
            if not resp.get("IsTruncated"):
                return out
            token = resp["NextContinuationToken"]

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            self._call(self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def presign_get(self, key: str, expires: int) -> str:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires
        )
