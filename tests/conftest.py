"""Fixtures shared by every test area: the tiny Inkling checkpoint everything runs on, and the real parts the
service-backed areas share (one SeaweedFS, one PostgreSQL database, one SQLite service, one service with a job
worker per session).

They are defined here, once, rather than imported into each area's conftest: an imported fixture is a second
definition with a cache of its own, so every area that imported `seaweed` started (and stopped) a SeaweedFS of
its own, and so on for the services."""

import contextlib
import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
import torch

from inkwell.models import init_base_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A deterministic `inkling-tiny` base model (seed 0), created once per test session."""
    return init_base_model("inkling-tiny", tmp_path_factory.mktemp("base") / "inkling-tiny", seed=0)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One embedded SeaweedFS for the session; each service on it has a bucket of its own."""
    from inkwell.service.storage.seaweed import EmbeddedSeaweed

    weed = EmbeddedSeaweed(tmp_path_factory.mktemp("seaweed"))
    weed.start()
    yield weed
    weed.stop(grace=0)  # a throwaway store: no graceful shutdown (2 s of weed's own) to wait for


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped afterwards."""
    from tests.service.helpers import scratch_pg_database

    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(scratch_pg_database("inkwell_test"))
        except psycopg2.OperationalError as exc:
            pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is required by the service tests: {exc}")
        yield url


@pytest.fixture(scope="session")
def sqlite_service(tmp_path_factory, seaweed):
    """The API on SQLite only, for tests that do not depend on the database backend (service, SDK and recipes
    tests; each makes tenants of its own)."""
    from tests.service.helpers import make_settings, start_service

    data_dir = tmp_path_factory.mktemp("svc-sqlite-only")
    svc = start_service(make_settings(data_dir, None, seaweed, max_upload_bytes=2 * 1024 * 1024))
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def training_service(seaweed, tmp_path_factory):
    """A service of its own with one real job worker process, so the worker sees only the jobs of the tests that
    use it (the console's and the SDK's SFT and GRPO runs: one worker start for all of them)."""
    from tests.service.helpers import make_settings, start_service
    from tests.service.test_jobs_e2e import start_worker, stop_worker

    data_dir = tmp_path_factory.mktemp("svc-training")
    svc = start_service(make_settings(data_dir, None, seaweed))
    worker = start_worker(svc, data_dir / "worker.log")
    yield svc
    stop_worker(worker)
    svc.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A child process still running when the tests are done (a worker nothing stopped) is killed and fails the
    run by name: the interpreter's exit would wait on it forever (multiprocessing joins its children), and CI
    would show only its timeout after every test had passed."""
    left = multiprocessing.active_children()
    for child in left:
        child.kill()
        child.join(5)
    if left:
        report = session.config.pluginmanager.get_plugin("terminalreporter")
        report.ensure_newline()
        report.write_line(f"child processes left running by the tests, killed: {', '.join(c.name for c in left)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
