"""Loading the worker's configuration: the file, the token file, the environment, this machine.

The shell around ``rc_worker.core.config_convert``: ``load_config`` reads YAML
with ruamel's round-trip loader, so every value keeps its line and column,
structures it with one private cattrs converter, and resolves every default
once: after it returns, nothing is unset. Every problem is a ``ConfigError``
that reads ``PATH:LINE:COLUMN: key.path: what is wrong; what is expected``.
What needs the machine (reading files, the user database, the host name, the
HTTP client's URL rules) is here; the decisions are in the core.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

from rc_worker.core import config_convert
from rc_worker.core.config import (
    DEFAULT_CONFIG_PATH,
    ENV_CONFIG,
    ENV_CONTROLLER_URL,
    ENV_HOST,
    ENV_REQUIRE_MANUAL_CLEAR,
    ENV_TOKEN,
    Config,
)
from rc_worker.core.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20

_TRUTHY = frozenset({"1", "true", "yes", "on"})
_FALSY = frozenset({"0", "false", "no", "off", ""})


def config_path(path: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path:
    """The file to read: ``path``, else ``$RC_WORKER_CONFIG``, else the default."""
    if path is not None:
        return Path(path)
    return Path(environ.get(ENV_CONFIG) or DEFAULT_CONFIG_PATH)


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    need_token: bool = True,
) -> Config:
    """Read, validate and resolve the worker's config file.

    ``environ`` (default ``os.environ``) supplies ``RC_WORKER_CONFIG`` (the
    path, when ``path`` is None) and the overrides ``RC_CONTROLLER_URL``,
    ``RC_TOKEN``, ``RC_HOST`` and ``RC_REQUIRE_MANUAL_CLEAR``.

    ``need_token=False`` is for tools that never talk to the controller
    (``rc-worker status``, ``rc-worker probe``): the token file is not read,
    so an operator can run them without the worker's secret, and a missing
    token is not an error.
    """
    env = os.environ if environ is None else environ
    file = config_path(path, env)
    config = _apply_environ(parse_file(file, read_token=need_token), env)
    if need_token and config.controller_url is not None and config.token is None:
        # Checked after the overrides: RC_TOKEN may be what supplies it.
        raise ConfigError(
            f"{file}:1:1: token: controller_url is set but no worker token is; "
            "expected token, token_file or the RC_TOKEN variable (leave controller_url "
            "out for an embedded controller)"
        )
    return config


def load_config_text(text: str, *, name: str = "<string>", base_dir: str = ".") -> Config:
    """Validate and resolve config ``text`` (no environment overrides); for tests and tools."""
    config = config_convert.parse_text(
        text, name=name, base_dir=Path(base_dir).absolute(), machine=THIS_MACHINE
    )
    return _apply_environ(config, {})


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``limit`` bytes.

    Opened non-blocking, so a FIFO cannot hang the worker, and never read past
    ``limit``, so ``/dev/zero`` cannot exhaust its memory. ``ValueError`` names the
    problem; ``OSError`` as from ``open``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is not a regular file (a pipe, a device or a directory)")
        if st.st_size > limit:
            raise ValueError(f"is larger than {limit} bytes")
        chunks = []
        total = 0
        while total <= limit:
            chunk = os.read(fd, limit + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise ValueError(f"is larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_file(file: Path, *, read_token: bool = True) -> Config:
    try:
        raw = read_regular_file(file, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ConfigError(
            f"{file}:1:1: (file): no such file; create it, or name another config file "
            "on the command line or in RC_WORKER_CONFIG"
        ) from None
    except ValueError as e:
        raise ConfigError(
            f"{file}:1:1: (file): the config {e}; name a regular file of at most 1 MiB"
        ) from None
    except OSError as e:
        raise ConfigError(
            f"{file}:1:1: (file): cannot read it ({e}); fix its permissions or encoding"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(
            f"{file}:{line}:{column}: (file): byte 0x{raw[e.start]:02x} is not UTF-8 text; "
            "save the config as UTF-8"
        ) from None
    # Relative paths in the file mean "next to this file", wherever the
    # worker was started from: the directory, absolute and without symlinks.
    return config_convert.parse_text(
        text,
        name=str(file),
        base_dir=file.parent.resolve(),
        read_token=read_token,
        machine=THIS_MACHINE,
    )


def controller_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be the controller's URL, or None: the same checks as the HTTP
    client ``rc-worker run`` opens it with, so check-config passes only what run accepts."""
    problem = config_convert.url_shape_problem(url)
    if problem:
        return problem
    bad = f"{url!r} is not a URL; expected http://HOST:PORT or https://HOST"
    try:
        import httpx

        parsed = httpx.URL(url)
        _ = urlsplit(url).port
    except (ValueError, httpx.InvalidURL) as e:
        return f"{bad} ({e})"
    if not parsed.host:
        return bad
    return None


def user_problem(name: str) -> str | None:
    """Why ``name`` cannot be a ``job_user`` on this machine, or None."""
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return f"no user {name!r} on this machine; expected an existing user such as nobody"
    return None


THIS_MACHINE = config_convert.ConfigMachine(
    read_file=read_regular_file, user_problem=user_problem, url_problem=controller_url_problem
)
"""The real answers to what checking a config asks of the machine."""


def _apply_environ(config: Config, env: Mapping[str, str]) -> Config:
    changes: dict[str, Any] = {}
    if env.get(ENV_CONTROLLER_URL):
        # One URL, or several separated by commas (a standby controller's after the active's).
        urls = [u.strip() for u in env[ENV_CONTROLLER_URL].split(",")]
        for url in urls:
            problem = controller_url_problem(url)
            if problem:
                raise ConfigError(f"{ENV_CONTROLLER_URL}: {problem}")
        changes["controller_url"] = urls[0] if len(urls) == 1 else tuple(urls)
    if env.get(ENV_TOKEN, "").strip():
        token = env[ENV_TOKEN].strip()
        problem = config_convert.worker_token_problem(token)
        if problem:
            raise ConfigError(f"{ENV_TOKEN}: {problem}")
        changes["token"] = token
    if env.get(ENV_HOST):
        host = env[ENV_HOST]
        problem = config_convert.host_problem(host)
        if problem:
            raise ConfigError(f"{ENV_HOST}: {problem}")
        changes["host"] = host
    # RC_REQUIRE_MANUAL_CLEAR can only make the worker more cautious: it is
    # ORed in, never overrides, and an unrecognised value is an error rather
    # than a silent false (the seed's RequireManualClear comment).
    if ENV_REQUIRE_MANUAL_CLEAR in env:
        raw = env[ENV_REQUIRE_MANUAL_CLEAR].strip().lower()
        if raw in _TRUTHY:
            changes["require_manual_clear"] = True
        elif raw not in _FALSY:
            raise ConfigError(
                f"{ENV_REQUIRE_MANUAL_CLEAR}: {env[ENV_REQUIRE_MANUAL_CLEAR]!r} is not a boolean; "
                "expected 1, true, yes or on to switch manual clearing on "
                "(0, false, no, off or empty change nothing)"
            )
    config = attrs.evolve(config, **changes) if changes else config
    if not config.host:
        config = attrs.evolve(config, host=socket.gethostname())
    return config
