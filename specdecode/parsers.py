"""Parsers of the numbers (and lists of numbers) that flags take, one wording for every range error: the option
table (``specdecode.options``), the subcommands' own flags, the server's and ``bench serve``'s.

A parser takes the text of a flag's value and returns the value, or raises ``BadValue``: a ValueError that
argparse reports as written (it is an ArgumentTypeError too), so one parser serves as a flag's ``type`` and
anywhere a ValueError is expected.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable


class BadValue(ValueError, argparse.ArgumentTypeError):
    """A flag value out of its range or of the wrong kind; the message is what argparse prints after the flag."""


def int_at_least(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer >= lo (and <= hi when given)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise BadValue(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise BadValue(f"must be an integer {f'{lo}..{hi}' if hi is not None else f'>= {lo}'}, got {s}")
        return v
    parse.__name__ = "integer"
    return parse


def float_in(lo: float, hi: float | None = None, lo_open: bool = False,
             hi_open: bool = False) -> Callable[[str], float]:
    """A number in [lo, hi] (its ends open as asked; NaN never). Without hi: any finite number >= lo (> lo);
    hi=inf admits inf itself."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise BadValue(f"expected a number, got {s!r}") from None
        if hi is not None:
            if math.isnan(v) or v < lo or (lo_open and v == lo) or v > hi or (hi_open and v == hi):
                raise BadValue(f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, got {s}")
        elif math.isnan(v) or v < lo or (lo_open and v == lo) or math.isinf(v):
            raise BadValue(f"must be {'finite and ' if v == math.inf else ''}{'>' if lo_open else '>='} {lo}, "
                           f"got {s}")
        return v
    parse.__name__ = "number"
    return parse


def list_of(parse: Callable[[str], Any], distinct_sorted: bool = True) -> Callable[[str], list]:
    """A comma-separated list of values of ``parse``: by default each distinct value once, smallest first (one
    config per value), strings after numbers; distinct_sorted=False keeps them as typed."""
    def parsed(s: str) -> list:
        parts = [p for p in s.replace(" ", "").split(",") if p]
        if not parts:
            raise BadValue(f"expected a comma-separated list, got {s!r}")
        values = [parse(p) for p in parts]
        if not distinct_sorted:
            return values
        return sorted(set(values), key=lambda v: (isinstance(v, str), 0 if isinstance(v, str) else v))
    parsed.__name__ = "list"
    return parsed


def choice(*names: str) -> Callable[[str], str]:
    """One of ``names``, in any case."""
    def parse(s: str) -> str:
        t = str(s).strip().lower()
        if t not in names:
            raise BadValue(f"invalid choice {s!r} (choose from {', '.join(names)})")
        return t
    parse.__name__ = "choice"
    return parse
