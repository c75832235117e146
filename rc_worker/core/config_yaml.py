"""The YAML side of reading a config: where a key path is in the file, and what is refused
before any value is looked at (explicit tags beyond YAML's core types, flow nesting deeper
than the parser should recurse into).

Sans-IO and independent of the converter: ``config_convert`` structures the plain data
this gives it, and when a value is wrong it asks a :class:`Locator` for the line and column
to name in the one-line error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NoReturn

from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from ruamel.yaml.scalarbool import ScalarBoolean

from rc_worker.core.errors import ConfigError

PathKey = tuple[str | int, ...]


def flow_depth(text: str) -> int:
    """The deepest nesting of YAML flow brackets (``[``, ``{``), a cheap bound checked before
    ruamel recurses into them (quoted text may over-count, which only errs strict)."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(depth - 1, 0)
    return deepest


STANDARD_TAG = re.compile(
    r"tag:yaml\.org,2002:(str|int|float|bool|null|map|seq|omap|set|merge|timestamp|binary|value)"
)


def refuse_tags(name: str, root: Node | None) -> None:
    """Refuse any explicit tag outside YAML's core types (``!!python/object/apply``...)."""
    stack = [] if root is None else [root]
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > 1_000_000:
            break
        tag = str(node.tag) if getattr(node, "tag", None) is not None else ""
        if tag and not STANDARD_TAG.fullmatch(tag):
            mark = node.start_mark
            raise ConfigError(
                f"{name}:{mark.line + 1}:{mark.column + 1}: (yaml): the tag {tag!r} is not "
                "allowed; remove it (a worker config uses plain values only)"
            )
        if isinstance(node, MappingNode):
            for k, v in node.value:
                stack.extend((k, v))
        elif isinstance(node, SequenceNode):
            stack.extend(node.value)


def plain(node: Any) -> Any:
    """Plain Python data from ruamel's round-trip types (keys as strings)."""
    if isinstance(node, Mapping):
        return {str(k) if not isinstance(k, str) else k: plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [plain(v) for v in node]
    # An anchored boolean is a ScalarBoolean, which is an int, not a bool.
    if isinstance(node, bool | ScalarBoolean):
        return bool(node)
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    return node


class Locator:
    """Finds the line and column of a key path in the round-trip YAML tree."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.root: Any = None
        self.nodes: Node | None = None

    def position(self, path: PathKey, *, at_key: bool = False) -> tuple[int, int]:
        """The 1-based line and column of the value at ``path`` (of its key if ``at_key``).

        An empty value (``key:`` with nothing after it) has no position of its
        own, so it is reported at its key. A path that leaves the tree is
        reported at the deepest node it reached.
        """
        node = self.root
        line, col = 0, 0
        for i, part in enumerate(path):
            last = i == len(path) - 1
            key = find_key(node, part) if isinstance(node, CommentedMap) else None
            if isinstance(node, CommentedMap) and key is not None:
                empty = node[key] is None
                line, col = node.lc.key(key) if (last and (at_key or empty)) else node.lc.value(key)
                node = node[key]
            elif isinstance(node, CommentedSeq) and isinstance(part, int) and part < len(node):
                line, col = node.lc.item(part)
                node = node[part]
            else:
                break
        return line + 1, col + 1

    def value(self, path: PathKey) -> Any:
        node = self.root
        for part in path:
            if isinstance(node, CommentedMap):
                part = find_key(node, part)
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                return None
        return node

    def source_text(self, path: PathKey) -> str | None:
        """The text of the scalar at ``path`` as written in the file, if it can be found."""
        node = self.nodes
        for part in path:
            if isinstance(node, MappingNode) and isinstance(part, str):
                node = next(
                    (v for k, v in node.value if isinstance(k, ScalarNode) and k.value == part),
                    None,
                )
            elif isinstance(node, SequenceNode) and isinstance(part, int):
                node = node.value[part] if part < len(node.value) else None
            else:
                return None
        return node.value if isinstance(node, ScalarNode) else None

    def is_scalar(self, path: PathKey) -> bool:
        node = self.value(path)
        return node is not None and not isinstance(node, CommentedMap | CommentedSeq)

    def fail_at(self, path: PathKey, message: str, *, at_key: bool = False) -> NoReturn:
        line, col = self.position(path, at_key=at_key)
        raise ConfigError(f"{self.name}:{line}:{col}: {dotted(path)}: {message}")

    def fail(self, _node: Any, path: PathKey, message: str) -> NoReturn:
        raise ConfigError(f"{self.name}:1:1: {dotted(path)}: {message}")


def find_key(node: CommentedMap, part: str | int) -> Any:
    """The key of ``node`` that ``part`` names (keys that are not strings match as text)."""
    if part in node:
        return part
    return next((k for k in node if str(k) == str(part)), None)


def dotted(path: PathKey) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"
