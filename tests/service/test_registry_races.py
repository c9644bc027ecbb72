"""Alias and version changes of one adapter racing each other over HTTP (threads against the running
service, many rounds): the answers are 2xx or a clean 4xx, never a 500, and no alias is left pointing
at a deleted version. SQLite serializes writers already; these bite on PostgreSQL. A publish checks the
adapter's base model under the adapter's lock, so a name taken for another base meanwhile is refused."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select

from inkwell.service.db import repo
from inkwell.service.db.models import AdapterVersionRow, AliasRow
from inkwell.service.errors import APIError
from inkwell.service.registry import Publication, VersionExists, publish
from inkwell.service.workers.job_worker import JobWorker
from tests.service.helpers import (
    CHAT,
    assert_error,
    import_dir,
    jsonl,
    make_adapter_dir,
    make_settings,
    start_service,
    upload,
)
from tests.service.test_jobs_e2e import submit
from tests.service.test_worker_outage import run_until_finished, worker_settings


def _seed(service, tenant_id: str, name: str, versions: int) -> None:
    """An adapter with `versions` rows (no objects: alias and delete routes only read rows)."""
    with service.sm() as s:
        repo.ensure_adapter(s, tenant_id, name, "inkling-tiny")
        for v in range(1, versions + 1):
            s.add(
                AdapterVersionRow(
                    tenant_id=tenant_id,
                    name=name,
                    version=v,
                    base_model="inkling-tiny",
                    base_config_sha256="0" * 64,
                    lora={},
                    files=[],
                    size_bytes=0,
                    metrics={},
                    source="import",
                )
            )
        s.commit()


def _race(service, key: str, calls: list[tuple[str, str, dict | None]]) -> list:
    """Send `calls` (method, path, json) at once, each on its own connection; the responses in order."""
    clients = [service.client(key) for _ in calls]
    barrier = threading.Barrier(len(calls))

    def go(i: int):
        method, path, body = calls[i]
        barrier.wait()
        return clients[i].request(method, path, json=body)

    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            return list(pool.map(go, range(len(calls))))
    finally:
        for c in clients:
            c.close()


def _code(resp) -> str | None:
    return resp.json()["error"]["code"] if resp.status_code >= 400 else None


def test_concurrent_puts_of_one_new_alias_all_succeed(service):
    tenant_id, key = service.new_tenant()
    _seed(service, tenant_id, "twins", 1)
    for round_ in range(30):
        alias = f"a{round_}"
        results = _race(service, key, [("PUT", f"/v1/adapters/twins/aliases/{alias}", {"version": 1})] * 4)
        assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
        assert all(r.json()["version"] == 1 for r in results)
    with service.client(key) as c:
        assert c.get("/v1/adapters/twins").json()["aliases"] == {f"a{i}": 1 for i in range(30)}


def test_delete_version_racing_alias_put_onto_it_leaves_no_dangling_alias(service):
    tenant_id, key = service.new_tenant()
    rounds = 20
    _seed(service, tenant_id, "dangle", rounds)
    for v in range(1, rounds + 1):
        delete, put = _race(
            service,
            key,
            [
                ("DELETE", f"/v1/adapters/dangle/versions/{v}", None),
                ("PUT", f"/v1/adapters/dangle/aliases/p{v}", {"version": v}),
            ],
        )
        outcome = (delete.status_code, _code(delete), put.status_code, _code(put))
        # One wins: the version is deleted (the alias refused) or aliased (the delete refused).
        assert outcome in ((200, None, 409, "version_deleted"), (409, "version_aliased", 200, None)), outcome
    with service.sm() as s:
        dangling = s.execute(
            select(AliasRow.alias, AliasRow.version)
            .join(
                AdapterVersionRow,
                (AdapterVersionRow.tenant_id == AliasRow.tenant_id)
                & (AdapterVersionRow.name == AliasRow.name)
                & (AdapterVersionRow.version == AliasRow.version),
            )
            .where(AliasRow.tenant_id == tenant_id, AdapterVersionRow.deleted_at.is_not(None))
        ).all()
    assert dangling == []


def test_concurrent_deletes_of_one_alias_one_204_one_404(service):
    tenant_id, key = service.new_tenant()
    _seed(service, tenant_id, "gone", 1)
    with service.client(key) as c:
        for round_ in range(15):
            assert c.put(f"/v1/adapters/gone/aliases/d{round_}", json={"version": 1}).status_code == 200
    for round_ in range(15):
        results = _race(service, key, [("DELETE", f"/v1/adapters/gone/aliases/d{round_}", None)] * 2)
        assert sorted((r.status_code, _code(r)) for r in results) == [(204, None), (404, "not_found")], [
            r.text for r in results
        ]


def test_first_publishes_of_a_new_adapter_with_distinct_versions_all_succeed(service, tmp_path):
    """Racing publishers that each create the adapter row must not read that race as VersionExists."""
    tenant_id, _ = service.new_tenant()
    src = make_adapter_dir(service, tmp_path / "src", "sglang")
    for round_ in range(4):
        name = f"fresh-{round_}"
        barrier = threading.Barrier(4)

        def go(version: int, name: str = name, barrier: threading.Barrier = barrier):
            pub = Publication(tenant_id, name, "inkling-tiny", "x" * 64, {"sglang": src}, {}, "import", version=version)
            barrier.wait()
            try:
                return publish(service.sm, service.store, pub).version
            except VersionExists:
                return None

        with ThreadPoolExecutor(4) as pool:
            assert sorted(pool.map(go, range(1, 5)), key=str) == [1, 2, 3, 4]


def _take_name(service, tenant_id: str, name: str, base: str) -> None:
    """`name` becomes an adapter of `base`, as another base's first publish winning the name would make it."""
    with service.sm() as s:
        repo.ensure_adapter(s, tenant_id, name, base)
        s.commit()


def test_publish_under_a_name_taken_for_another_base_meanwhile_is_409_and_leaves_nothing(service, tmp_path):
    """Whatever a caller checked before (an import's or a job's submission), the publish itself finds the name
    taken for another base model under the adapter's lock: no version of one base joins an adapter of another."""
    tenant_id, key = service.new_tenant()
    src = make_adapter_dir(service, tmp_path / "src", "sglang")
    _take_name(service, tenant_id, "taken", "tiny-other")
    pub = Publication(tenant_id, "taken", "inkling-tiny", "x" * 64, {"sglang": src}, {}, "import")
    with pytest.raises(APIError) as info:
        publish(service.sm, service.store, pub)
    assert (info.value.status, info.value.code) == (409, "adapter_base_mismatch")
    with service.client(key) as client:  # the routes refuse it up front too
        assert_error(import_dir(client, src, "taken", "sglang"), 409, "adapter_base_mismatch")
        body = {"base_model": "inkling-tiny", "dataset_id": upload(client, jsonl(CHAT)).json()["id"]}
        assert_error(client.post("/v1/jobs", json={**body, "adapter_name": "taken"}), 409, "adapter_base_mismatch")
    assert service.store.list_objects(f"adapters/{tenant_id}/") == []
    with service.sm() as s:
        assert repo.max_version(s, tenant_id, "taken") == 0


def test_a_job_whose_adapter_name_went_to_another_base_fails_with_adapter_base_mismatch(tmp_path, seaweed):
    """The job's check at submission passed; by the time it publishes the name belongs to another base: the job
    fails with the same code the API uses, and nothing is published."""
    svc = start_service(make_settings(tmp_path / "svc", None, seaweed))  # its own database: only this job to claim
    try:
        tenant_id, key = svc.new_tenant()
        with svc.client(key) as client:
            _, job = submit(client, "contested", max_steps=1, checkpoint_every=1)
            _take_name(svc, tenant_id, "contested", "tiny-other")
            done = run_until_finished(client, JobWorker(worker_settings(svc, tmp_path, "w"), worker_id="w"), job)
            assert done["state"] == "failed" and done["error"]["code"] == "adapter_base_mismatch", done
            assert done["adapter_version"] is None and "tiny-other" in done["error"]["message"]
            assert client.get("/v1/adapters/contested/versions").json()["data"] == []
    finally:
        svc.stop()
