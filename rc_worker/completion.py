"""Shell completion scripts for ``rc`` and ``rc-worker``, generated from their parsers.

``rc completion bash`` (or ``zsh``) prints a script; source it, or install it where the
shell looks (docs/controller.md). The script is built from the argparse parser at the
time it is printed, so it always offers exactly the subcommands, options and choices
that the installed version has. Completing after ``--`` (the job's own command) or an
option's free-form value falls back to file names.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

import attrs

__all__ = ["SHELLS", "Spec", "configure", "render", "spec_of"]

SHELLS = ("bash", "zsh")


@attrs.frozen
class Spec:
    """What one (sub)command offers: its words, and the options that take a value."""

    words: tuple[str, ...]
    """Option strings, subcommand names and positional choices."""
    takes_value: tuple[str, ...]
    choices: dict[str, tuple[str, ...]] = attrs.field(hash=False)
    """Options whose value is one of a fixed set."""


def spec_of(parser: argparse.ArgumentParser) -> dict[str, Spec]:
    """Every command path (``""`` for the top level, else the subcommand's name) and its Spec."""
    out: dict[str, Spec] = {}
    _walk(parser, "", out)
    return out


def _walk(parser: argparse.ArgumentParser, path: str, out: dict[str, Spec]) -> None:
    words: list[str] = []
    takes: list[str] = []
    choices: dict[str, tuple[str, ...]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                words.append(name)
                _walk(sub, name if not path else f"{path} {name}", out)
        elif action.option_strings:
            words.extend(s for s in action.option_strings if s.startswith("--"))
            if action.nargs != 0:
                takes.extend(action.option_strings)
                if action.choices is not None:
                    for s in action.option_strings:
                        choices[s] = tuple(str(c) for c in action.choices)
        elif action.choices is not None:
            words.extend(str(c) for c in action.choices)
    out[path] = Spec(tuple(words), tuple(takes), choices)


_SAFE = re.compile(r"[A-Za-z0-9_./=:+-]+")


def _q(word: str) -> str:
    if not _SAFE.fullmatch(word):
        raise ValueError(f"completion word {word!r} needs quoting")  # our own parsers never do
    return word


def render(parser: argparse.ArgumentParser, shell: str) -> str:
    prog = parser.prog
    func = "_" + re.sub(r"[^A-Za-z0-9]", "_", prog) + "_complete"
    specs = spec_of(parser)
    if shell == "bash":
        return _bash(prog, func, specs)
    if shell == "zsh":
        return _zsh(prog, func, specs)
    raise ValueError(f"unknown shell {shell!r}; use one of {', '.join(SHELLS)}")


def _cases(specs: dict[str, Spec], indent: str, end: str) -> tuple[str, str, str]:
    """Case arms (POSIX syntax, valid in bash and zsh): words, value options, choices."""
    words, takes, choices = [], [], []
    for path, spec in specs.items():
        key = f'"{path}"'
        words.append(f'{indent}{key}) cands="{" ".join(map(_q, spec.words))}" {end}')
        if spec.takes_value:
            takes.append(f'{indent}{key}) takes="{" ".join(map(_q, spec.takes_value))}" {end}')
        for opt, values in spec.choices.items():
            arm = f'{indent}"{path}|{_q(opt)}") cands="{" ".join(map(_q, values))}" {end}'
            choices.append(arm)
    return "\n".join(words), "\n".join(takes), "\n".join(choices)


# Shared by both scripts: walk the words before the cursor, tracking the command path
# (subcommand names), skipping each value-taking option's value, stopping at "--".
_SCAN = """\
    local cmdpath="" takes="" prev="" word cands i
    for ((i = @FIRST@; i < @LAST@; i++)); do
        word="${@WORDVAR@[i]}"
        if [[ "$word" == "--" ]]; then
            return 1
        fi
        takes=""
        case "$cmdpath" in
@TAKES@
        esac
        if [[ -n "$prev" ]]; then
            prev=""
        elif [[ "$word" == -* ]]; then
            [[ " $takes " == *" $word "* && "$word" != *=* ]] && prev="$word"
        else
            cands=""
            case "$cmdpath" in
@WORDS@
            esac
            if [[ " $cands " == *" $word "* ]]; then
                cmdpath="${cmdpath:+$cmdpath }$word"
            fi
        fi
    done
    cands=""
    if [[ -n "$prev" ]]; then
        case "$cmdpath|$prev" in
@CHOICES@
        esac
        [[ -z "$cands" ]] && return 1
    else
        case "$cmdpath" in
@WORDS@
        esac
    fi
"""


def _scan(specs: dict[str, Spec], first: str, last: str, words_var: str, indent: str) -> str:
    words, takes, choices = _cases(specs, indent, ";;")
    return (
        _SCAN.replace("@FIRST@", first)
        .replace("@LAST@", last)
        .replace("@WORDVAR@", words_var)
        .replace("@TAKES@", takes)
        .replace("@CHOICES@", choices)
        .replace("@WORDS@", words)
    )


def _bash(prog: str, func: str, specs: dict[str, Spec]) -> str:
    body = _scan(specs, "1", "COMP_CWORD", "COMP_WORDS", " " * 12)
    return f"""# bash completion for {prog}; generated by `{prog} completion bash`.
# Load it with: source <({prog} completion bash)
{func}() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}"
    COMPREPLY=()
{body}    COMPREPLY=($(compgen -W "$cands" -- "$cur"))
}}
complete -o default -o bashdefault -F {func} {prog}
"""


def _zsh(prog: str, func: str, specs: dict[str, Spec]) -> str:
    # zsh arrays count from 1 and $words[1] is the command itself, as COMP_WORDS[0] is in bash.
    # Where bash falls back to its defaults (-o default), zsh is told to: _default completes
    # file names (the job's own command after "--", an option's free-form value).
    body = _scan(specs, "2", "CURRENT", "words_", " " * 12).replace(
        "return 1", '_default "$@"; return'
    )
    return f"""#compdef {prog}
# zsh completion for {prog}; generated by `{prog} completion zsh`.
# Load it with: source <({prog} completion zsh)   (after compinit), or save it as _{prog}
# in a directory on $fpath.
{func}() {{
    local -a words_
    words_=("${{words[@]}}")
{body}    compadd -- ${{=cands}}
}}
if [[ "$funcstack[1]" == "_{prog}" ]]; then
    {func} "$@"
else
    compdef {func} {prog}
fi
"""


def configure(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``completion bash|zsh`` to ``rc-worker``."""
    p = sub.add_parser("completion", help="print a shell completion script")
    p.add_argument("shell", choices=SHELLS, help="the shell to complete for")
    p.set_defaults(func=_rc_worker_completion)


def _rc_worker_completion(args: argparse.Namespace) -> int:
    from rc_worker.cli import build_parser

    return print_script(build_parser, args.shell)


def print_script(build: Callable[[], argparse.ArgumentParser], shell: str) -> int:
    sys.stdout.write(render(build(), shell))
    return 0
