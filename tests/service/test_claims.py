"""Job claiming under contention (SKIP LOCKED on PostgreSQL, conditional UPDATE on SQLite):
every queued job goes to exactly one worker; an expired lease is re-claimable and fences out
the worker that lost it."""

import threading
import time
from datetime import timedelta

from sqlalchemy import update

from inkwell.service.db import repo
from inkwell.service.db.models import JobRow
from tests.service.helpers import CHAT, jsonl, upload


def queue_jobs(service, count: int) -> list[str]:
    _, key = service.new_tenant()
    with service.client(key) as client:
        ds = upload(client, jsonl(CHAT)).json()["id"]
        body = {"base_model": "inkling-tiny", "dataset_id": ds}
        return [client.post("/v1/jobs", json={**body, "adapter_name": f"c{i}"}).json()["id"] for i in range(count)]


def retire(service, ids: list[str]) -> None:
    """Leave nothing claimable for the worker processes of later tests."""
    with service.sm() as s:
        s.execute(update(JobRow).where(JobRow.id.in_(ids)).values(state="cancelled", lease_expires_at=None))
        s.commit()


def test_each_queued_job_is_claimed_exactly_once(service):
    ids = set(queue_jobs(service, 8))
    claims: dict[str, list[str]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(name: str) -> None:
        barrier.wait()
        try:
            while True:
                with service.sm() as s:
                    row = repo.claim_job(s, name, timedelta(minutes=5))
                    s.commit()
                if row is None:
                    return
                if row.id in ids:
                    claims.setdefault(row.id, []).append(name)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert errors == []
        assert set(claims) == ids and all(len(v) == 1 for v in claims.values()), claims
    finally:
        retire(service, list(ids))


def test_expired_lease_is_reclaimed_and_fences_the_old_worker(service):
    ids = queue_jobs(service, 1)
    try:
        with service.sm() as s:
            first = repo.claim_job(s, "old", timedelta(seconds=0.5))
            s.commit()
        assert first.id == ids[0] and first.attempts == 1
        with service.sm() as s:
            assert repo.claim_job(s, "new", timedelta(minutes=5)) is None  # lease still valid
            s.commit()
        time.sleep(0.7)
        with service.sm() as s:
            second = repo.claim_job(s, "new", timedelta(minutes=5))
            s.commit()
        assert second.id == ids[0] and second.worker_id == "new" and second.attempts == 2
        with service.sm() as s:
            assert repo.renew_lease(s, ids[0], "old", timedelta(minutes=5)) is None
            assert not repo.update_held_job(s, ids[0], "old", progress={"step": 99})
            assert repo.update_held_job(s, ids[0], "new", progress={"step": 1})
            s.commit()
    finally:
        retire(service, ids)
