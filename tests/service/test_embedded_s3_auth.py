"""The embedded SeaweedFS lets in only the service: S3 needs the data dir's keys (an anonymous or wrongly keyed
client gets 403), its filer's own HTTP port needs a JWT, and the keys are in a file only the owner reads. The
service's own uploads, downloads and presigned URLs work as before."""

import stat

import boto3
import httpx
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError

from inkwell.service.db import repo
from tests.service.helpers import CHAT, import_dir, jsonl, make_adapter_dir, upload


def refusals(client, bucket: str, key: str) -> list[tuple[int, str]]:
    """(HTTP status, S3 error code) of a list, a read and a write by `client`, each of which must fail."""
    calls = (
        lambda: client.list_objects_v2(Bucket=bucket),
        lambda: client.get_object(Bucket=bucket, Key=key),
        lambda: client.put_object(Bucket=bucket, Key="intruder.txt", Body=b"x"),
    )
    found = []
    for call in calls:
        with pytest.raises(ClientError) as refused:
            call()
        response = refused.value.response
        found.append((response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Code"]))
    return found


def test_anonymous_and_wrong_key_clients_are_refused_while_the_service_works(sqlite_service, seaweed, tmp_path):
    tenant_id, key = sqlite_service.new_tenant()
    with sqlite_service.client(key) as client:
        dataset = upload(client, jsonl(CHAT))
        assert dataset.status_code == 201, dataset.text
        directory = make_adapter_dir(sqlite_service, tmp_path / "adapter", "sglang")
        assert import_dir(client, directory, "guarded", "sglang").status_code == 201
        files = client.get("/v1/adapters/guarded/versions/1/download?layout=sglang").json()["files"]
        for f in files:
            assert client.get(f["download_path"]).status_code == 200  # the service reads S3 with its keys
            assert httpx.get(f["url"]).status_code == 200  # a presigned URL carries them
    with sqlite_service.sm() as s:
        object_key = repo.get_dataset(s, tenant_id, dataset.json()["id"]).s3_key
    bucket = sqlite_service.settings.bucket

    def s3(**keys):
        return boto3.session.Session().client("s3", endpoint_url=seaweed.endpoint, region_name="us-east-1", **keys)

    anonymous = s3(config=Config(signature_version=UNSIGNED))
    assert refusals(anonymous, bucket, object_key) == [(403, "AccessDenied")] * 3
    wrong = s3(aws_access_key_id=seaweed.access_key, aws_secret_access_key="not-the-secret")
    assert all(status == 403 for status, _ in refusals(wrong, bucket, object_key))
    assert "intruder.txt" not in {o.key for o in sqlite_service.store.list_objects("")}

    filer = f"http://127.0.0.1:{seaweed.ports['filer.port']}/buckets/{bucket}/{object_key}"
    assert httpx.get(filer).status_code == 401
    assert httpx.put(filer.replace(object_key, "intruder.txt"), content=b"x").status_code == 401

    assert stat.S_IMODE((seaweed.data_dir / "credentials.json").stat().st_mode) == 0o600
    assert stat.S_IMODE(seaweed.data_dir.stat().st_mode) == 0o700
