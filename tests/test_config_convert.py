"""The pure config converter asks the machine only through its ``ConfigMachine``.

``config_load`` (the shell) gives it the real machine; these tests give it a
fake one and check that every machine-dependent check goes through it, and
that without one (``NO_MACHINE``) nothing is read.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from rc_worker.config_load import THIS_MACHINE, controller_url_problem, load_config_text
from rc_worker.core.config_convert import NO_MACHINE, ConfigMachine, parse_text, url_shape_problem
from rc_worker.core.errors import ConfigError


class FakeMachine:
    """A machine with one token file and one user, that records what it was asked."""

    def __init__(self) -> None:
        self.files = {"/etc/rc/token": b"  s3cret\n"}
        self.asked: list[tuple[str, object]] = []

    def read_file(self, path: str, limit: int) -> bytes:
        self.asked.append(("read_file", (path, limit)))
        try:
            return self.files[path]
        except KeyError:
            raise FileNotFoundError(2, "No such file or directory", path) from None

    def user_problem(self, name: str) -> str | None:
        self.asked.append(("user_problem", name))
        return None if name == "runner" else f"no user {name!r} here"

    def url_problem(self, url: str) -> str | None:
        self.asked.append(("url_problem", url))
        return "refused by the fake" if "bad" in url else None

    def machine(self) -> ConfigMachine:
        return ConfigMachine(
            read_file=self.read_file, user_problem=self.user_problem, url_problem=self.url_problem
        )


def test_the_token_file_is_read_through_the_machine_from_an_absolute_base() -> None:
    fake = FakeMachine()
    config = parse_text(
        "controller_url: http://ctl:8080\ntoken_file: token\ndevices: [gpu0]\n",
        name="w.yaml",
        base_dir=PurePosixPath("/etc/rc"),
        machine=fake.machine(),
    )
    assert config.token == "s3cret"
    assert config.token_file == "/etc/rc/token"
    assert ("read_file", ("/etc/rc/token", 64 * 1024)) in fake.asked
    assert ("url_problem", "http://ctl:8080") in fake.asked


def test_a_missing_token_file_is_a_located_error() -> None:
    with pytest.raises(ConfigError, match=r"^w\.yaml:1:13: token_file: cannot read the token file"):
        parse_text(
            "token_file: nowhere\ndevices: [gpu0]\n",
            name="w.yaml",
            base_dir="/etc/rc",
            machine=FakeMachine().machine(),
        )


def test_job_users_are_checked_by_the_machine_at_their_line() -> None:
    fake = FakeMachine()
    text = "job_user: runner\ndevices:\n  - name: gpu0\n    job_user: ghost\n"
    with pytest.raises(
        ConfigError, match=r"^w\.yaml:4:15: devices\[0\]\.job_user: no user 'ghost'"
    ):
        parse_text(text, name="w.yaml", base_dir="/", machine=fake.machine())
    assert [a for a in fake.asked if a[0] == "user_problem"] == [
        ("user_problem", "runner"),
        ("user_problem", "ghost"),
    ]


def test_the_machine_judges_the_controller_url() -> None:
    with pytest.raises(ConfigError, match="controller_url: refused by the fake"):
        parse_text(
            "controller_url: http://bad:1\ntoken: t\ndevices: [gpu0]\n",
            name="w.yaml",
            base_dir="/",
            machine=FakeMachine().machine(),
        )


def test_without_a_machine_nothing_is_read_and_only_shapes_are_checked() -> None:
    config = parse_text(
        "job_user: anyone-at-all\ncontroller_url: http://ctl\ntoken: t\ndevices: [gpu0]\n",
        name="w.yaml",
        base_dir="/srv",
        machine=NO_MACHINE,
    )
    assert config.job_user == "anyone-at-all"
    with pytest.raises(ConfigError, match="token_file: cannot read the token file"):
        parse_text("token_file: t\ndevices: [gpu0]\n", name="w.yaml", base_dir="/srv")
    with pytest.raises(ConfigError, match="controller_url: 'ftp://x' is not a URL"):
        parse_text("controller_url: ftp://x\ndevices: [gpu0]\n", name="w.yaml", base_dir="/")


def test_relative_paths_resolve_against_the_base_dir_as_written() -> None:
    config = parse_text(
        "probe_dir: ./probes//extra\nverify_dir: /abs/v\ndevices: [gpu0]\n",
        name="w.yaml",
        base_dir="/etc/rc",
    )
    assert config.probe_dir == "/etc/rc/probes/extra"
    assert config.verify_dir == "/abs/v"


@pytest.mark.parametrize(
    ("url", "shape_refuses", "whole_refuses"),
    [
        ("http://ctl:8080", False, False),
        ("https://ctl", False, False),
        ("ftp://ctl", True, True),
        ("http://", True, True),
        # A colon with no port after it, or port 0: the core's port rule, in both.
        ("http://ftp://x", True, True),
        ("http://h:/", True, True),
        ("http://h:0", True, True),
        # Shaped like a URL, but the HTTP client would refuse the port: only the shell sees it.
        ("http://ctl:99999", False, True),
    ],
)
def test_the_shell_url_check_adds_to_the_pure_shape_check(
    url: str, shape_refuses: bool, whole_refuses: bool
) -> None:
    shape = url_shape_problem(url)
    assert (shape is not None) == shape_refuses
    assert (controller_url_problem(url) is not None) == whole_refuses
    if shape is not None:
        assert controller_url_problem(url) == shape
    assert THIS_MACHINE.url_problem is controller_url_problem


def test_load_config_text_uses_this_machine() -> None:
    with pytest.raises(ConfigError, match="no user 'no-such-user-xyz'"):
        load_config_text("job_user: no-such-user-xyz\ndevices: [gpu0]\n")
