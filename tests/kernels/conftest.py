"""The kernel tests' child runs, started ahead of their tests (`helpers.LANE`)."""

import pytest

from tests.kernels.helpers import LANE


def pytest_collection_finish(session: pytest.Session) -> None:
    LANE.expect(mark.args[0] for item in session.items for mark in item.iter_markers("child"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    LANE.stop()
