"""What a request constrains its output to, in vLLM's current shape (``StructuredOutputsParams``)."""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice`` (the
    output is one of these strings), ``grammar`` (EBNF / llama.cpp GBNF) or ``json_object=True`` (any JSON
    object). ``disable_any_whitespace`` makes JSON output compact (no free whitespace between tokens)."""
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    _key: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"Invalid structured outputs: {msg}")

        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            bad("give exactly one of json, regex, choice, grammar or json_object"
                + (f" (got {', '.join(given)})." if given else " (got none)."))
        kind = given[0]
        if self.json_object not in (None, True, False):
            bad(f"json_object must be a boolean, got {self.json_object!r}.")
        if not isinstance(self.disable_any_whitespace, bool):
            bad(f"disable_any_whitespace must be a boolean, got {self.disable_any_whitespace!r}.")
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    bad(f"json is not valid JSON: {e}.")
            elif isinstance(self.json, dict):
                schema = self.json
            else:
                bad(f"json must be a JSON schema (a dict or a JSON string), got {type(self.json).__name__}.")
            if not isinstance(schema, (dict, bool)):
                bad("json must be a JSON schema object.")
            text = _json.dumps(schema, ensure_ascii=False)  # key order kept: it is the output's order
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                bad("choice must be a non-empty list of non-empty strings.")
            self.choice = list(self.choice)
            text = _json.dumps(self.choice, ensure_ascii=False)
        elif kind in ("regex", "grammar"):
            text = getattr(self, kind)
            if not isinstance(text, str) or not text.strip():
                bad(f"{kind} must be a non-empty string.")
        else:
            text = ""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            bad(f"{kind} contains an invalid Unicode code point (a lone surrogate).")
        self._key = (kind, text, self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        return self._key[0]

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (a cache key): the kind, its canonical text and the flags."""
        return self._key
