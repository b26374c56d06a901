"""Drafts from a request's predicted output (OpenAI's Predicted Outputs: ``prediction`` on a chat request).

A client that knows most of the answer in advance (a file to rewrite with a small change, a document to
re-emit with corrections) sends it as the prediction. The lookup sources (prompt lookup, suffix decoding) then
draft from it first: while the output so far is a prefix of the prediction, the next tokens of the prediction;
once the output has left it (an edit), the continuation of the output's latest tokens where they occur in the
prediction, at the occurrence nearest to the output's own length, since an edit moves the rest of the text by a
little, not to another repeat of the same lines. The drafts are verified as any other, so the output is the
target's whatever the prediction says; a wrong prediction only costs rejected rows.
"""
from __future__ import annotations

import difflib

import numpy as np

from specdecode.speculative.suffix_match import longest_suffix_matches

MIN_MATCH = 2   # output tokens that must match the prediction to pick up from it again after leaving it
MAX_MATCH = 16  # the longest match tried first


def predicted(request, tokens: list[int], k: int) -> list[int]:
    """Up to k tokens of ``request``'s prediction that should follow ``tokens`` (its context, possibly extended by
    drafts); none without a prediction or where the output matches no part of it."""
    pred = request.prediction_ids
    if not pred or k <= 0:
        return []
    out = tokens[len(request.prompt_token_ids):]
    n = len(out)
    if pred[:n] == out:
        return list(pred[n:n + k])
    return _resync(np.asarray(pred, dtype=np.int64), np.asarray(out, dtype=np.int64), k)


def _resync(pred: np.ndarray, out: np.ndarray, k: int) -> list[int]:
    """What follows the longest suffix of ``out`` (MAX_MATCH down to MIN_MATCH tokens) in ``pred``, at the
    occurrence ending nearest to position len(out)."""
    if len(out) < MIN_MATCH:
        return []
    hits = longest_suffix_matches(pred, out, MIN_MATCH, MAX_MATCH)
    if not hits.size:
        return []
    start = int(hits[np.argmin(np.abs(hits + 1 - len(out)))]) + 1
    return pred[start:start + k].tolist()


def prediction_usage(prediction: list[int], output: list[int]) -> tuple[int, int]:
    """OpenAI's (accepted_prediction_tokens, rejected_prediction_tokens): the prediction's tokens that appear in
    the output, in order (the matching blocks of a diff of the two), and the rest of them."""
    matcher = difflib.SequenceMatcher(None, prediction, output, autojunk=False)  # junk heuristics would undercount
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted
