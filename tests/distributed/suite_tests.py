"""The pytest side of a distributed suite, written once: a test class subclasses
:class:`SuiteTests` and names its cases script, world size and launch mode. The class launches
the script once on msrun ranks (the class-scoped ``suite_results`` fixture, in
``tests/conftest.py``), runs one test per case and checks that every rank ran every case."""
from __future__ import annotations

import functools
from typing import Optional

import harness


@functools.lru_cache(maxsize=None)
def _suite(script: str) -> harness.Suite:
    return harness.load_suite(harness.DIST_DIR / script)


class SuiteTests:
    SCRIPT: str = ""
    NPROC: int = 2
    TIMEOUT: float = 600.0
    BLOCKING: Optional[bool] = True      # the launch mode every rank must report; None: unchecked

    @classmethod
    def suite(cls) -> harness.Suite:
        return _suite(cls.SCRIPT)

    @classmethod
    def launch(cls, tmp_path_factory) -> harness.SuiteResults:
        suite = cls.suite()
        return harness.launch_suite(harness.DIST_DIR / cls.SCRIPT, suite.name,
                                    tmp_path_factory.mktemp(suite.name), nproc=cls.NPROC,
                                    timeout=cls.TIMEOUT)

    def pytest_generate_tests(self, metafunc):
        if "name" in metafunc.fixturenames:
            metafunc.parametrize("name", self.suite().names)

    def test_every_rank_ran_every_case(self, suite_results):
        suite_results.verify_every_rank_ran(self.suite().names, self.NPROC)
        if self.BLOCKING is not None:
            suite_results.verify_launch_mode(blocking=self.BLOCKING)

    def test_case(self, suite_results, name):
        suite_results.verify(name)
