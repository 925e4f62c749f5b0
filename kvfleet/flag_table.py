"""Command-line flags as table rows: each :class:`Flag` names the config field it sets, so a
parser is built from a table (:func:`add_flags`), the parsed values come back grouped by the
config that owns them (:func:`values_by_owner`), and a config renders back to the command line
that parses to it (:func:`render_argv`). Defaults are the configs' own declarations
(:func:`declared_default`), never restated in a table; rules between flags are the configs'
to check (their ``__post_init__``), not a parser's.

The router's table is kvfleet.router.flags; ``kvfleet up``'s is kvfleet.deploy.cluster_flags,
which takes the router's rows it shares from there.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

DECLARED: Any = object()  # a Flag's default: the field's default in its config dataclass

# ``--help`` sections, in order: what each holds.
GROUPS: dict[str, str] = {
    "model": "what is served and how it runs",
    "cache": "the KV cache: its blocks, pool and host tier",
    "scheduling": "who runs when, and what is refused",
    "routing": "which replica serves a request",
    "security": "keys, TLS and what may be read",
    "fleet": "processes, addresses, sizes and lifecycle",
    "observability": "metrics and logs (traces: the OTEL_* variables)",
}


@dataclass(frozen=True)
class Flag:
    """One command-line flag.

    ``field``: the config field it sets, as a dotted path under the table's root config
    (``"replica.scheduler.max_num_seqs"``; a path through a dict field names a key); None for
    a flag its command reads itself (``dest`` names it). ``group``: its ``--help`` section
    (a key of :data:`GROUPS`). ``convert`` turns a parsed value that is not None into the
    field's value; ``show`` turns a field's value into flag text (help's ``{default}`` and
    :func:`render_argv`; default: ``%g`` for floats, ``str`` otherwise). ``only``: the commands
    that take it (empty: every command the table serves). ``always``: :func:`render_argv`
    writes it even at its default.
    """

    flag: str
    field: Optional[str]
    help: str
    group: str
    type: Optional[Callable[[str], Any]] = None
    choices: Optional[tuple] = None
    action: Optional[str] = None
    default: Any = DECLARED
    metavar: Optional[str] = None
    dest: Optional[str] = None
    only: tuple[str, ...] = ()
    convert: Optional[Callable[[Any], Any]] = None
    show: Optional[Callable[[Any], str]] = None
    required: bool = False
    always: bool = False

    def __post_init__(self) -> None:
        assert self.group in GROUPS, f"{self.flag}: unknown help group {self.group!r}"

    @property
    def name(self) -> str:
        """The argparse destination."""
        return self.dest or (self.field or "").replace(".", "__")

    def text(self, value: Any) -> str:
        """``value`` as this flag's text."""
        if self.show is not None:
            return self.show(value)
        return f"{value:g}" if isinstance(value, float) else str(value)

    def at(self, field: Optional[str], **changes: Any) -> "Flag":
        """This flag setting ``field`` instead (another table's root), with ``changes``."""
        return dataclasses.replace(self, field=field, **changes)


def by_name(flags: Iterable[Flag]) -> dict[str, Flag]:
    """``--flag`` → its row."""
    return {f.flag: f for f in flags}


def declared_default(owners: Mapping[str, type], path: str) -> Any:
    """The default the dataclass owning ``path`` declares for it (``owners``: path prefix →
    dataclass, ``""`` the root; a ``dict`` owner's keys default to None)."""
    owner, _, name = path.rpartition(".")
    cls = owners[owner]
    if cls is dict:
        return None
    spec = {f.name: f for f in dataclasses.fields(cls)}[name]
    if spec.default is not dataclasses.MISSING:
        return spec.default
    assert spec.default_factory is not dataclasses.MISSING, f"{path} has no default"
    return spec.default_factory()


def add_flags(p: argparse.ArgumentParser, flags: Iterable[Flag], command: str,
              default_of: Callable[[Flag], Any]) -> dict[str, Any]:
    """Add ``flags`` (those ``command`` takes) to ``p``, each in its :data:`GROUPS` section.
    ``default_of``: a row's default when it says :data:`DECLARED`. Returns the sections by
    name (a command adds its own flags to them)."""
    groups = {name: p.add_argument_group(name, text) for name, text in GROUPS.items()}
    order = list(GROUPS)
    for f in sorted(flags, key=lambda f: order.index(f.group)):  # usage lists them by section
        if f.only and command not in f.only:
            continue
        default = default_of(f) if f.default is DECLARED else f.default
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.help.replace("{default}",
                                                                       f.text(default))}
        if f.action in ("store_false", "store_true"):
            kwargs["action"] = f.action  # the flag's absence is the declared default
        else:
            kwargs["default"] = default
            if f.action:
                kwargs["action"] = f.action
            if f.required:
                kwargs["required"] = True
            if f.choices is not None:
                kwargs["choices"] = f.choices
            else:
                kwargs["metavar"] = f.metavar or f.flag.lstrip("-").upper().replace("-", "_")
        if f.type is not None:
            kwargs["type"] = f.type
        groups[f.group].add_argument(f.flag, **kwargs)
    return groups


def values_by_owner(args: argparse.Namespace, flags: Iterable[Flag],
                    owners: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Parsed values of ``flags`` that set a field, grouped by the path of the config (or
    dict) owning it: ``{"replica.scheduler": {"max_num_seqs": 8}, …}``."""
    values: dict[str, dict[str, Any]] = {owner: {} for owner in owners}
    for f in flags:
        if f.field is None or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if f.convert is not None and value is not None:
            value = f.convert(value)
        owner, _, name = f.field.rpartition(".")
        values[owner][name] = value
    return values


def field_value(config: Any, path: str) -> Any:
    """The value at dotted ``path`` in ``config`` (a dict on the way is read by key; a key it
    lacks reads None)."""
    value = config
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part)
    return value


def render_argv(config: Any, defaults: Any, flags: Iterable[Flag]) -> list[str]:
    """The command line, in table order, that sets ``config``'s values where they differ from
    ``defaults`` (and the ``always`` rows): the inverse of parsing ``flags``."""
    argv: list[str] = []
    for f in flags:
        if f.field is None:
            continue
        value = field_value(config, f.field)
        if value == field_value(defaults, f.field) and not f.always:
            continue
        if f.action == "store_false":
            argv += [] if value else [f.flag]
        elif f.action == "store_true":
            argv += [f.flag] if value else []
        elif value is not None:
            argv += [f.flag, f.text(value)]
    return argv
