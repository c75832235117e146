"""A cattrs converter for JSON wire messages whose errors name the field (sans-IO).

The rules are the protocol's (docs/protocol.md, "Transport"): unknown keys are
ignored, ``null`` means "absent" wherever a field is optional, and a known field
of the wrong type is one :class:`ProtocolError` whose message names the field by
its path (``recovery[0].claim: expected a string or null``). cattrs' own hooks
would collect every error into an exception group with its own wording; the
hooks here stop at the first and keep the wording both sides already answer
with, so the controller's ``400`` messages and the worker's rejections read as
they did before the converter existed.

Per-field metadata (``attrs.field(metadata=...)``), all optional:

- ``KEY``: the JSON key, when it differs from the attribute's name;
- ``EXPECTED``: what to say when the value itself has the wrong type
  (``command``: "a non-empty list of strings" rather than "a list of strings");
- ``OMIT``: a value that is left out of the JSON altogether (a ``session`` the
  client fills in at send time, ``stale_offer: false``);
- ``IF_NULL``: the value when the key is present and ``null`` (rather than the
  default: a worker that sends ``"faults": null`` still said something);
- ``LOCAL``: not on the wire at all (kept in Python, never sent or read).
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar, Union

import attrs
import cattrs

KEY: Final = "rc_key"
EXPECTED: Final = "rc_expected"
OMIT: Final = "rc_omit"
IF_NULL: Final = "rc_if_null"
LOCAL: Final = "rc_local"

JsonObject = dict[str, object]
"""An object passed through as it came (a ``sweep`` report, kept and shown as sent)."""


class ProtocolError(ValueError):
    """A malformed message: ``path`` says where (``recovery[0].claim``), ``problem`` what."""

    def __init__(self, problem: str, path: tuple[str | int, ...] = ()) -> None:
        self.problem = problem
        self.path = path
        super().__init__(f"{self.where}: {problem}")

    @property
    def where(self) -> str:
        """The field's path as the messages write it; ``body`` for the message itself."""
        out = ""
        for part in self.path:
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
        return out or "body"

    @property
    def sentence(self) -> str:
        """The same, worded as the worker's rejections are (``grace_s must be a number``)."""
        if self.problem.startswith("expected "):
            return f"{self.where} must be {self.problem.removeprefix('expected ')}"
        return str(self)

    def under(self, part: str | int, expected: str | None = None) -> ProtocolError:
        """This error one level down, inside ``part``; ``expected`` rewords an error
        about the value of ``part`` itself."""
        problem = self.problem
        if expected is not None and not self.path and problem.startswith("expected "):
            problem = f"expected {expected}"
        return ProtocolError(problem, (part, *self.path))


def _origin(t: object) -> object:
    return typing.get_origin(t)


def _is_optional(t: object) -> bool:
    args = typing.get_args(t)
    return _origin(t) in (Union, types.UnionType) and type(None) in args and len(args) == 2


def _non_none(t: object) -> Any:
    return next(a for a in typing.get_args(t) if a is not type(None))


def _is_homogeneous_tuple(t: object) -> bool:
    args = typing.get_args(t)
    return _origin(t) is tuple and len(args) == 2 and args[1] is Ellipsis


def _is_str_mapping(t: object) -> bool:
    return _origin(t) in (dict, Mapping) and typing.get_args(t)[:1] == (str,)


def _is_json_object(t: object) -> bool:
    return _is_str_mapping(t) and typing.get_args(t)[1] is object


def _str(value: object, _: object) -> str:
    if not isinstance(value, str):
        raise ProtocolError("expected a string")
    return value


def _opt_str(value: object, _: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ProtocolError("expected a string or null")
    return value


def _int(value: object, _: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError("expected an integer or null")
    return value


def _float(value: object, _: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError("expected a number or null")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ProtocolError("must be a finite number")
    return number


def _bool(value: object, _: object) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError("expected true or false")
    return value


def _json_object(value: object, _: object) -> JsonObject:
    if not isinstance(value, dict):
        raise ProtocolError("expected a JSON object or null")
    return dict(value)


def _any(value: object, _: object) -> object:
    return value


def make_converter() -> cattrs.Converter:
    """A converter with the hooks above; the protocol module registers its messages on it."""
    c = cattrs.Converter()
    c.register_structure_hook(str, _str)
    c.register_structure_hook(int, _int)
    c.register_structure_hook(float, _float)
    c.register_structure_hook(bool, _bool)
    c.register_structure_hook_factory(attrs.has, lambda cls: structure_fields(c, cls))
    c.register_unstructure_hook_factory(attrs.has, lambda cls: unstructure_fields(c, cls))
    # Predicates registered later win: the general shapes first, their special cases after.
    # The shapes are factories: each type's hook is made once, its item's hook looked up
    # then (as cattrs makes its own hooks), not at every value.
    c.register_structure_hook_factory(_is_optional, lambda t: _optional_hook(c, t))
    c.register_structure_hook_factory(_is_homogeneous_tuple, lambda t: _tuple_hook(c, t))
    c.register_structure_hook_factory(_is_str_mapping, lambda t: _mapping_hook(c, t))
    c.register_structure_hook_func(lambda t: t is object, _any)
    c.register_structure_hook_func(_is_json_object, _json_object)
    c.register_structure_hook_func(lambda t: t == (str | None), _opt_str)
    return c


def _optional_hook(c: cattrs.Converter, t: Any) -> Callable[[object, Any], object]:
    inner = _non_none(t)
    structure = c.get_structure_hook(inner)

    def hook(value: object, _: Any) -> object:
        return None if value is None else structure(value, inner)

    return hook


def _tuple_hook(c: cattrs.Converter, t: Any) -> Callable[[object, Any], tuple[object, ...]]:
    item = typing.get_args(t)[0]
    if item is str:

        def strings(value: object, _: Any) -> tuple[object, ...]:
            # Worded for the whole field, as one check: "ready: expected a list of strings".
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ProtocolError("expected a list of strings")
            return tuple(value)

        return strings
    structure = c.get_structure_hook(item)

    def hook(value: object, _: Any) -> tuple[object, ...]:
        if not isinstance(value, list):
            raise ProtocolError("expected a list of objects")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(structure(v, item))
            except ProtocolError as e:
                raise e.under(i) from None
        return tuple(out)

    return hook


def _mapping_hook(c: cattrs.Converter, t: Any) -> Callable[[object, Any], dict[str, object]]:
    item = typing.get_args(t)[1]
    if item is str:

        def strings(value: object, _: Any) -> dict[str, object]:
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise ProtocolError("expected an object of string values")
            return dict(value)

        return strings
    structure = c.get_structure_hook(item)

    def hook(value: object, _: Any) -> dict[str, object]:
        if not isinstance(value, dict):
            raise ProtocolError("expected a JSON object")
        out = {}
        for k, v in value.items():
            try:
                out[k] = structure(v, item)
            except ProtocolError as e:
                raise e.under(k) from None
        return out

    return hook


@attrs.frozen
class _Field:
    name: str
    key: str
    type: Any
    required: bool
    expected: str | None
    if_null: object
    omit: object
    local: bool

    @property
    def nullable_type(self) -> Any:
        # A field that may be left out may be null, and a string's error says so.
        return str | None if self.type is str and not self.required else self.type


_NOTHING: Final = object()


def wire_fields(cls: type) -> list[_Field]:
    hints = typing.get_type_hints(cls)
    out = []
    for a in attrs.fields(cls):
        md = a.metadata
        out.append(
            _Field(
                name=a.name,
                key=md.get(KEY, a.name),
                type=hints[a.name],
                required=a.default is attrs.NOTHING,
                expected=md.get(EXPECTED),
                if_null=md.get(IF_NULL, _NOTHING),
                omit=md.get(OMIT, _NOTHING),
                local=md.get(LOCAL, False),
            )
        )
    return out


def structure_fields(c: cattrs.Converter, cls: type) -> Callable[[object, Any], object]:
    """The structure hook of an attrs message: each field by its key, ``null`` as absent."""
    # Worked out once per message: each field's hook (as cattrs makes its own hooks) and
    # what a missing value means.
    fields = [
        (
            f.name,
            f.key,
            f.nullable_type,
            c.get_structure_hook(f.nullable_type),
            f.required,
            _is_optional(f.type),
            f.if_null,
            f.expected,
        )
        for f in wire_fields(cls)
        if not f.local
    ]

    def hook(value: object, _: object) -> object:
        if not isinstance(value, dict):
            raise ProtocolError("expected a JSON object")
        kwargs: dict[str, object] = {}
        for name, key, ftype, structure, required, optional, if_null, expected in fields:
            raw = value.get(key)
            if raw is None:
                if key in value and if_null is not _NOTHING:
                    kwargs[name] = if_null
                elif required and optional:
                    kwargs[name] = None
                elif required:
                    raise ProtocolError("required", (key,))
                continue
            try:
                kwargs[name] = structure(raw, ftype)
            except ProtocolError as e:
                raise e.under(key, expected) from None
        return cls(**kwargs)

    return hook


# Leaves returned as they are, tested first by exact type: most values written are these,
# and every message field goes through here (a subclass takes the general path below).
_LEAVES: Final = frozenset({str, int, float, bool, type(None)})


# Whether a type is an attrs class, by type: attrs.has looks it up afresh every time.
_messages: dict[type, bool] = {}


def plain(c: cattrs.Converter, value: object) -> object:
    """``value`` as JSON-ready data: messages through their hooks, tuples as lists."""
    kind = type(value)
    if kind in _LEAVES:
        return value
    # Plain containers by exact type first: neither is a message, and the general
    # checks below (a Mapping is an ABC) cost more than the copy.
    if kind is dict:
        return {k: plain(c, v) for k, v in value.items()}  # type: ignore[attr-defined]
    if kind is list or kind is tuple:
        return [plain(c, v) for v in value]  # type: ignore[attr-defined]
    message = _messages.get(kind)
    if message is None:
        message = _messages[kind] = attrs.has(kind)
    if message:
        return c.unstructure(value)
    if isinstance(value, list | tuple):
        return [plain(c, v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(c, v) for k, v in value.items()}
    return value


def unstructure_fields(c: cattrs.Converter, cls: type) -> Callable[[object], JsonObject]:
    """The unstructure hook of an attrs message: each field under its key, in order."""
    fields = [(f.name, f.key, f.omit) for f in wire_fields(cls) if not f.local]

    def hook(obj: object) -> JsonObject:
        out: JsonObject = {}
        for name, key, omit in fields:
            value = getattr(obj, name)
            if omit is not _NOTHING and value == omit:
                continue
            out[key] = plain(c, value)
        return out

    return hook


T = TypeVar("T")

converter = make_converter()
"""The one converter of the wire: worker and controller both read and write through it.
The protocol's modules register the hooks of their few irregular messages on it."""


def structure(value: object, cls: type[T]) -> T:
    """``value`` (decoded JSON) as a ``cls``; a malformed one raises :class:`ProtocolError`."""
    return converter.structure(value, cls)


def unstructure(message: object) -> JsonObject:
    """``message`` as the JSON object the wire carries."""
    out = converter.unstructure(message)
    assert isinstance(out, dict)
    return out


def to_wire(body: object) -> object:
    """``body`` as JSON-ready data: messages anywhere in it unstructured, the rest as it is."""
    return plain(converter, body)
