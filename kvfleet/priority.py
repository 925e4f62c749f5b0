"""Request priority classes, shared by router and worker: one definition, one parser.

A priority is an integer; **lower runs first** (vLLM's convention). Three named classes map
onto it — ``interactive`` = 0, ``default`` = 1, ``batch`` = 2 — and any integer in
[``MIN_PRIORITY``, ``MAX_PRIORITY``] is allowed too. A number's *band* is the named class whose
rules apply to it (the router's admission headroom, the worker's batch share cap): at most 0 →
``interactive``, 1 → ``default``, 2 or more → ``batch``. Behind a key file, an API key's class
(``default`` unless the file names one) is the highest priority its requests may ask for
(:func:`within_key`). Metrics label a request by
:func:`label` (the three names and ``other``), so a label's values stay bounded.
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

from kvfleet.errors import InvalidArgument, PermissionDenied

INTERACTIVE, DEFAULT, BATCH = 0, 1, 2
CLASSES: dict[str, int] = {"interactive": INTERACTIVE, "default": DEFAULT, "batch": BATCH}
CLASS_NAMES: dict[int, str] = {v: k for k, v in CLASSES.items()}
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
OTHER_LABEL = "other"  # the metrics label of a number that is not one of the named classes


def parse(value: Union[str, int, None], field: str = "priority") -> int:
    """A class name or an integer (a decimal string is one too) → its priority number.

    Raises:
        InvalidArgument: naming ``field``, for an unknown class name, a non-integer (a JSON
            boolean or float included) or a number outside [MIN_PRIORITY, MAX_PRIORITY].
    """
    if isinstance(value, str):
        text = value.strip()
        if text in CLASSES:
            return CLASSES[text]
        try:
            value = int(text)
        except ValueError:
            raise InvalidArgument(f"{field} must be one of {sorted(CLASSES)} or an integer, "
                                  f"got {value!r}", field=field) from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{field} must be one of {sorted(CLASSES)} or an integer, got "
                              f"{type(value).__name__}", field=field)
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise InvalidArgument(f"{field} must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {value}",
                              field=field)
    return value


def band(priority: int) -> str:
    """The named class whose rules apply to ``priority`` (see the module docstring)."""
    if priority <= INTERACTIVE:
        return "interactive"
    return "default" if priority == DEFAULT else "batch"


def label(priority: int) -> str:
    """The bounded metrics label: a named class, else ``other``."""
    return CLASS_NAMES.get(priority, OTHER_LABEL)


def describe(priority: int) -> str:
    """How a refusal names a request's class: ``batch``, or ``priority 5 (batch)``."""
    name = CLASS_NAMES.get(priority)
    return name if name is not None else f"priority {priority} ({band(priority)})"


DEFAULT_ADMIT = {"interactive": 1.0, "default": 1.0, "batch": 0.8}


def parse_admit(text: str, flag: str = "--priority-admit") -> dict[str, float]:
    """``"batch=0.8,default=0.9"`` → each class's admission fraction of fleet capacity, the
    classes not named keeping :data:`DEFAULT_ADMIT`'s.

    Raises:
        ValueError: naming ``flag``, for an unknown class, a malformed pair or a fraction
            outside (0, 1].
    """
    admit = dict(DEFAULT_ADMIT)
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or name not in CLASSES:
            raise ValueError(f"{flag}: expected CLASS=FRACTION with CLASS one of "
                             f"{sorted(CLASSES)}, got {pair!r}")
        try:
            fraction = float(value)
        except ValueError:
            raise ValueError(f"{flag}: {name}'s fraction must be a number, got {value!r}") from None
        if not 0 < fraction <= 1:
            raise ValueError(f"{flag}: {name}'s fraction must be in (0, 1], got {fraction:g}")
        admit[name] = fraction
    check_admit(admit, flag)
    return admit


def check_admit(admit: Mapping[str, float], what: str = "priority_admit") -> None:
    """Raises ValueError (naming ``what``) unless ``admit`` maps every class to (0, 1] and a
    higher class is never admitted at a lower fraction than a lower one."""
    if set(admit) != set(CLASSES) or not all(0 < admit[c] <= 1 for c in CLASSES):
        raise ValueError(f"{what} must map each of {sorted(CLASSES)} to a fraction in (0, 1], "
                         f"got {dict(admit)!r}")
    if not admit["interactive"] >= admit["default"] >= admit["batch"]:
        raise ValueError(f"{what}: fractions must not grow from interactive to batch (a lower "
                         f"class must not keep headroom from a higher one), got {dict(admit)!r}")


def format_admit(admit: Mapping[str, float]) -> str:
    """The inverse of :func:`parse_admit` (flag text)."""
    return ",".join(f"{c}={admit[c]:g}" for c in CLASSES)


def within_key(requested: Optional[int], key_class: Optional[int],
               field: str = "priority") -> Optional[int]:
    """The priority a request runs at under its API key: its own, else the key's class.

    The key's class is a ceiling: a request may lower its priority (a larger number), never
    raise it above its key's; otherwise a tenant pinned to ``batch`` could pass the batch
    admission cap and preempt everyone. ``key_class`` None (an open router, which has no
    tenants to keep apart) sets no ceiling.

    Raises:
        PermissionDenied: naming ``field``, for a priority above the key's class.
    """
    if requested is None:
        return key_class
    if key_class is not None and requested < key_class:
        # Numbers on both sides: a key of class interactive (0) refuses -5, also "interactive".
        asked = CLASS_NAMES.get(requested) or f"{requested} (band {band(requested)})"
        raise PermissionDenied(f"{field}: {asked} is above this API key's class "
                               f"{describe(key_class)} = {key_class} (a request may only lower "
                               f"its priority: a number >= {key_class})", field=field)
    return requested


def resolve(requested: Optional[int], key_default: Optional[int]) -> int:
    """The request's own priority, else its API key's default, else ``default``."""
    if requested is not None:
        return requested
    return DEFAULT if key_default is None else key_default
