"""Module-scoped fixtures of the PersistIOManager tests (``home``, ``persist``, ``instance``): a persist location and an
on-disk Dagster instance (SQLite storage under a temp DAGSTER_HOME), each made once per
test module. Use with ``pytest_plugins = ["tests.io_manager_fixtures"]``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import dagster as dg
import pytest

from dagster_project.resources import PersistResource


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("persist"))


@pytest.fixture(scope="module")
def persist(home: str) -> Iterator[PersistResource]:
    pr = PersistResource(home=home)
    yield pr
    pr.close()


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test(temp_dir=str(tmp_path_factory.mktemp("dagster"))) as inst:
        yield inst


def root_error(e: BaseException) -> BaseException:
    """The user's exception inside Dagster's wrappers (``user_exception`` / ``__cause__``)."""
    while True:
        nxt = getattr(e, "user_exception", None) or e.__cause__
        if nxt is None:
            return e
        e = nxt


def interleaving(persist: PersistResource, concurrent: Callable[[], None]) -> Any:
    """A ``PersistIOManager`` whose first write runs ``concurrent`` once, between computing
    its updates and committing them (the ``before_commit`` hook): a deterministic race."""
    from dagster_project.io_manager import PersistIOManager

    class Interleaving(PersistIOManager):
        def create_io_manager(self, context: dg.InitResourceContext) -> Any:
            impl = super().create_io_manager(context)
            fired: list[bool] = []

            def hook() -> None:
                if not fired:
                    fired.append(True)
                    concurrent()

            impl.before_commit = hook
            return impl

    return Interleaving(persist=persist)
