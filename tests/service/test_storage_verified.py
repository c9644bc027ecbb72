"""The store's verified reads: a damaged object raises ObjectCorrupt and is never handed out whole."""

import hashlib

import pytest

from inkwell.service.storage import ObjectCorrupt


def test_verified_stream_holds_back_its_last_chunk(sqlite_service):
    store = sqlite_service.store
    data = bytes(range(256)) * (10 * 1024 + 7)  # about 2.5 MiB: three chunks
    store.put_bytes("probe/stream.bin", data, create_only=False)
    sha = hashlib.sha256(data).hexdigest()
    assert b"".join(store.open_verified_stream("probe/stream.bin", sha, len(data))) == data
    with pytest.raises(ObjectCorrupt):
        store.open_verified_stream("probe/stream.bin", sha, len(data) + 1)  # a size mismatch: before any byte
    got = []
    with pytest.raises(ObjectCorrupt):
        for chunk in store.open_verified_stream("probe/stream.bin", "0" * 64, len(data)):
            got.append(chunk)
    assert 0 < len(b"".join(got)) < len(data)  # never the whole body
    assert store.get_verified("probe/stream.bin", sha, len(data)) == data
    with pytest.raises(ObjectCorrupt):
        store.get_verified("probe/stream.bin", "0" * 64, len(data))
