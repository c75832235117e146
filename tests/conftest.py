"""Shared test configuration.

Hypothesis profiles (cattrs ``tests/conftest.py`` style): "ci" is the default (the
same examples every run); ``HYPOTHESIS_PROFILE=explore`` searches at random, and
``HYPOTHESIS_PROFILE=dev`` runs fewer examples.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from rc_worker.logs import THIRD_PARTY

settings.register_profile(
    # The default, what CI runs: the same examples every run (derandomize), so that a
    # pass or a failure is the code's, not the draw's.
    "ci",
    deadline=None,
    max_examples=100,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    # Random search, on purpose: it finds new failing fault plans (three in one night of
    # benchmarking), each printed with its replay line. HYPOTHESIS_PROFILE=explore.
    "explore",
    deadline=None,
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=20,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put the logging configuration back after a test that sets it up in-process."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    others = {name: logging.getLogger(name).level for name in THIRD_PARTY}
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        for name, old in others.items():
            logging.getLogger(name).setLevel(old)


@pytest.fixture(autouse=True)
def private_state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test's ``rc serve`` without a storage option keeps its state in a directory of
    its own, never in the user's ``~/.local/state/rc`` (which would leak between tests
    and runs). Child processes inherit it through the environment."""
    saved = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("xdg-state"))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("XDG_STATE_HOME", None)
        else:
            os.environ["XDG_STATE_HOME"] = saved
