"""Shell completion for rc and rc-worker, and what the parsers promise (--version, help)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rc_worker import __version__, completion
from rc_worker.cli import build_parser as worker_parser
from rc_worker.controller.rc_cli import build_parser as rc_parser

BIN = Path(sys.executable).parent


def script(prog: str, shell: str) -> str:
    done = subprocess.run(
        [str(BIN / prog), "completion", shell], capture_output=True, text=True, check=True
    )
    assert done.stderr == ""
    return done.stdout


def complete_bash(prog: str, words: list[str]) -> list[str]:
    """Run the generated bash completion function in a real bash, as readline would."""
    func = "_" + prog.replace("-", "_") + "_complete"
    driver = (
        f"source /dev/stdin\n"
        f"COMP_WORDS=({' '.join(repr(w) for w in [prog, *words])})\n"
        f"COMP_CWORD={len(words)}\n"
        f"{func}\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", driver],
        input=script(prog, "bash"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.stderr == ""
    return [line for line in done.stdout.splitlines() if line]


@pytest.mark.parametrize(
    ("words", "offered"),
    [
        (["su"], ["submit"]),
        (["idle", "box1/gpu0", "d"], ["drain"]),
        (["run", "--select", "x", "--re"], ["--reconnect"]),
        (["logs", "--f"], ["--follow"]),
        (["completion", "z"], ["zsh"]),
        (["serve", "--listen", "127.0.0.1:0", "--w"], ["--worker-token", "--webhook"]),
    ],
)
def test_rc_bash_completion(words: list[str], offered: list[str]) -> None:
    assert complete_bash("rc", words) == offered


def test_nothing_is_offered_inside_the_jobs_own_command() -> None:
    assert complete_bash("rc", ["run", "--", "ls", "--q"]) == []


def test_rc_worker_bash_completion() -> None:
    assert complete_bash("rc-worker", ["--log-level", "debug", "check"]) == ["check-config"]
    assert complete_bash("rc-worker", ["--log-level", "w"]) == ["warning"]
    assert complete_bash("rc-worker", ["completion", ""]) == ["--help", "bash", "zsh"]


@pytest.mark.parametrize("prog", ["rc", "rc-worker"])
def test_zsh_script_offers_the_same_words(prog: str) -> None:
    text = script(prog, "zsh")
    assert text.startswith(f"#compdef {prog}\n")
    assert f"compdef _{prog.replace('-', '_')}_complete {prog}" in text
    parser = rc_parser() if prog == "rc" else worker_parser()
    for path, spec in completion.spec_of(parser).items():
        assert f'"{path}") cands="{" ".join(spec.words)}" ;;' in text
    # The scan is shared with the bash script (tested by running it): only the glue differs.
    bash = script(prog, "bash")
    body = re.search(r"local cmdpath.*?\n    fi\n", text, re.S)
    assert body is not None
    assert (
        body.group(0)
        .replace("words_[i]", "COMP_WORDS[i]")
        .replace("i = 2; i < CURRENT", "i = 1; i < COMP_CWORD")
        .replace('_default "$@"; return', "return 1")
        in bash
    )


def test_unknown_shell_is_a_usage_error() -> None:
    done = subprocess.run(
        [str(BIN / "rc"), "completion", "fish"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2
    assert "invalid choice: 'fish'" in done.stderr
    with pytest.raises(ValueError, match="unknown shell 'fish'"):
        completion.render(rc_parser(), "fish")


@pytest.mark.parametrize("prog", ["rc", "rc-worker"])
def test_version(prog: str) -> None:
    done = subprocess.run(
        [str(BIN / prog), "--version"], capture_output=True, text=True, check=True
    )
    assert done.stdout == f"{prog} {__version__}\n"


def _actions(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.Action]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest for choice in action._choices_actions}
            for name, sub in action.choices.items():
                assert name in helped, f"{path} {name} has no help text"
                out.extend(_actions(sub, f"{path} {name}"))
        else:
            out.append((path, action))
    return out


@pytest.mark.parametrize("build", [rc_parser, worker_parser])
def test_every_option_and_argument_has_help(build: object) -> None:
    parser = build()  # type: ignore[operator]
    actions = _actions(parser, parser.prog)
    assert len(actions) > 20
    missing = [
        f"{path} {a.option_strings or a.dest}"
        for path, a in actions
        if not a.help or a.help == argparse.SUPPRESS
    ]
    assert missing == []
