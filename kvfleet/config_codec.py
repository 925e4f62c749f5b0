"""Frozen config dataclasses to JSON-able dicts and back: a Ray Serve application config
carries the replicas' :class:`~kvfleet.worker.replica.replica.ReplicaConfig` as plain ``args``, which
an operator can read (and ``serve deploy`` could apply) as written."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def to_dict(obj) -> dict:
    """A dataclass instance (nested ones included) as a dict of JSON types (tuples → lists)."""
    return _plain(dataclasses.asdict(obj))


def from_dict(cls: type[T], data: dict) -> T:
    """Rebuild ``cls`` from :func:`to_dict`'s output; nested dataclass fields are rebuilt by
    their annotated type, lists become tuples again.

    Raises:
        TypeError: ``data`` names a field ``cls`` does not have (the message names it).
        ValueError: a value the dataclass's own checks refuse.
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # T: a dataclass
    unknown = sorted(set(data) - names)
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown field(s) {unknown}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kind = _dataclass_in(hints[name])
        if kind is not None and isinstance(value, dict):
            kwargs[name] = from_dict(kind, value)
        else:
            kwargs[name] = _tuples(value)
    return cls(**kwargs)


def _dataclass_in(hint) -> type | None:
    """The dataclass type of a field annotated ``D`` or ``Optional[D]``, else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(hint) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
