"""A stand-in for engine.request.Request in unit tests of proposers and policies."""
from __future__ import annotations

from types import SimpleNamespace


class FakeRequest(SimpleNamespace):
    """The given fields, and a fresh Request's value of every other field that proposers, policies and the
    grammar's speculation read (weakly referable, as the engine's requests are)."""

    def __init__(self, **fields):
        defaults = dict(draft_prefix=[], num_forced=0, num_output_tokens=0, draft_computed=0, finish_reason=None,
                        prediction_ids=None, matcher=None)
        if "params" in fields:  # Request.argmax_rows, for requests without a seed
            defaults["argmax_rows"] = fields["params"].greedy
        super().__init__(**{**defaults, **fields})
