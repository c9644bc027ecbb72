"""Object storage: a boto3 wrapper for any S3 endpoint and the embedded SeaweedFS launcher."""

from inkwell.service.storage.s3 import (
    ObjectCorrupt,
    ObjectExists,
    ObjectInfo,
    ObjectMissing,
    ObjectStore,
    StorageUnavailable,
)

__all__ = ["ObjectCorrupt", "ObjectExists", "ObjectInfo", "ObjectMissing", "ObjectStore", "StorageUnavailable"]
