"""Under pytest-xdist each test file is one unit of work (tests/conftest.py: file_group): a file's tests run on one
worker, so that its module and session fixtures are built once. Grouping by `xdist_group` marks failed silently
on pytest 9.2 (every file's tests were spread over the workers, each building the fixtures again)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import file_group


@pytest.fixture(scope="module")
def workers_here(tmp_path_factory):
    """The folder in which each worker that runs a test of this file leaves its name (shared by the workers)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's base is <run>/popen-gwN
    folder = root / "workers_of_test_xdist_groups"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.mark.parametrize("i", range(6))
def test_one_file_runs_on_one_worker(workers_here, i):
    (workers_here / os.environ.get("PYTEST_XDIST_WORKER", "main")).touch()
    assert len(list(workers_here.iterdir())) == 1, sorted(p.name for p in workers_here.iterdir())


def test_files_sharing_a_fixture_are_one_unit():
    assert file_group("tests/test_fsdp_memory.py::test_a[x::y]") == file_group("tests/test_distributed.py::test_b")
    assert file_group("tests/test_experiments.py::test_c") == "test_configs"
    assert file_group("tests/test_figures.py::test_d[legend]") == "test_figures"
