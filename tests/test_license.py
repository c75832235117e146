"""The package declares its licence the way current setuptools wants (PEP 639)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_license_is_an_spdx_string_with_its_file() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "MIT"  # a string: a table is deprecated
    assert meta["project"]["license-files"] == ["LICENSE"]
    # setuptools reads an SPDX string only from 77 on; older ones would reject it.
    [setuptools] = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    match = re.fullmatch(r"setuptools>=(\d+)", setuptools)
    assert match is not None
    assert int(match.group(1)) >= 77
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) ")
    assert "the rc_worker authors" in text.splitlines()[2]
    assert 'THE SOFTWARE IS PROVIDED "AS IS"' in text
