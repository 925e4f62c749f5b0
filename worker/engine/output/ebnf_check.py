"""A check xgrammar does not make: whether an EBNF grammar's ``root`` derives any finite
string (a grammar without one would accept no output at all)."""

from __future__ import annotations

import re

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_.-]*|[()|]|\S')


def root_is_productive(normalized: str) -> bool:
    """Whether rule ``root`` of a normalized xgrammar EBNF (``str(Grammar)``) derives a finite
    string. A rule is productive when one of its alternatives has only productive items
    (literals, character classes, productive rules); computed as a fixpoint. Constructs this
    reader does not know count as productive, so it never refuses a grammar that has output.
    """
    rules: dict[str, list[str]] = {}
    for line in normalized.splitlines():
        head, sep, body = line.partition(" ::= ")
        if sep:
            rules[head.strip()] = _TOKEN.findall(body)
    productive: set[str] = set()

    def expr(toks: list[str], i: int) -> tuple[bool, int]:
        ok, i = alt(toks, i)
        while i < len(toks) and toks[i] == "|":
            more, i = alt(toks, i + 1)
            ok = ok or more
        return ok, i

    def alt(toks: list[str], i: int) -> tuple[bool, int]:
        ok = True
        while i < len(toks) and toks[i] not in ("|", ")"):
            if toks[i] == "(":
                sub, i = expr(toks, i + 1)
                i += 1  # the closing parenthesis
            else:
                t = toks[i]
                sub = t not in rules or t in productive  # literal, class or unknown: productive
                i += 1
            ok = ok and sub
        return ok, i

    changed = True
    while changed:
        changed = False
        for name, toks in rules.items():
            if name not in productive and expr(toks, 0)[0]:
                productive.add(name)
                changed = True
    return "root" not in rules or "root" in productive
