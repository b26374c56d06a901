"""The engine's side of structured outputs: grammar-checked drafts, masked verification rows, commits.

Exactness. A request's output must follow the target restricted to what the grammar allows. The verifier
masks every target row it checks with the grammar state after the drafts before that row, so the rejection
sampler works on masked distributions unchanged: greedy rows take the masked argmax, sampled rows accept and
resample against the masked target. A draft the grammar forbids could never be accepted, so the draft ends
before it. Tokens the grammar forces are drafted for free (one-hot, a function of the committed state only),
which keeps the draft distribution the verifier assumes honest.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from specdecode.layers.sampler import argmax
from specdecode.speculative.proposer import Proposal, one_hot_rows, reads_draft_probs, widened

if TYPE_CHECKING:
    from specdecode.structured.grammar import Matcher


def matcher_of(request) -> Matcher | None:
    """The request's grammar state; None where its output is unconstrained."""
    return request.matcher


def forced_drafts(requests: list, budgets: list[int]) -> list[list[int]]:
    """Per request, up to budgets[i] tokens of the text its grammar forces next (empty where nothing is forced
    or the request is unconstrained). The engine drafts them itself, ahead of the proposer's drafts: the
    proposer drafts after them (``draft_prefix``, see ``context_of``)."""
    out = []
    for r, b in zip(requests, budgets):
        m = matcher_of(r)
        out.append(m.forced(b) if m is not None and b > 0 else [])
        r.forced_text = m.forced_text if out[-1] else ""
    return out


def learn_spelling(request, forced: list[int], accepted: int, emitted: list[int]) -> None:
    """The verifier rejected forced[accepted] and emitted the model's own token there: the grammar's table
    of spellings learns it (see ``Spellings``). Greedy requests only: a sampled request's token there is a draw
    from the residual distribution, not the model's preferred split."""
    m = matcher_of(request)
    if (m is not None and request.params.greedy and accepted < len(forced) and len(emitted) > accepted
            and request.forced_text):
        m.spellings.learn(request.forced_text, forced, accepted, emitted[accepted])


def constrain_proposal(requests: list, prop: Proposal, forced: list[list[int]], budgets: list[int],
                       proposer=None, text_lookup=None) -> Proposal:
    """The step's drafts of each constrained request under its grammar, at most budgets[i] for request i:
    ``forced[i]``, then the proposer's drafts ``prop`` (drafted after forced[i]) fitted to the grammar.

    - The forced tokens are one-hot drafts: they depend only on the committed state, never on what a drafter
      drew.
    - The proposer's drafts end at the first token the grammar forbids. A drafted token the grammar forbids
      has target probability 0 after masking, so it would be rejected with certainty. Dropping it is exact
      when it was proposed with certainty (one-hot drafts: the residual after it is the masked target itself)
      and for requests verified by argmax (greedy and seeded); an unseeded sampled draft-model token stays as the
      last draft instead, so that the rejection sampler resamples from the residual exactly as it would without
      the grammar.
    - A draft that was not cut is extended with the tokens the grammar forces after it (argmax-verified
      requests: after a cut too); the extension is a function of the tokens before it, one-hot in the draft
      probabilities.
    - Where the proposer drafted nothing, ``text_lookup`` (a ``TextLookup``) may: one-hot drafts of the prompt
      phrase the output is copying, and of the token that closes the quoted value after it, a function of
      the committed state and the forced tokens. Such a request is marked ``text_drafted``: its proposer
      drafted nothing this step.
    """
    tokens = [list(d) for d in prop.tokens]
    probs = prop.probs
    changed = False
    for i, r in enumerate(requests):
        m = matcher_of(r)
        if m is None:
            continue
        fixed, d, budget = forced[i], tokens[i], max(0, budgets[i])
        m.advance(fixed)  # forced() returned only tokens the grammar accepts
        try:
            if text_lookup is not None and not d and budget > len(fixed):
                d = _copied_text(m, r, fixed, budget - len(fixed), text_lookup)
            r.text_drafted = bool(d) and not tokens[i]
            keep = m.valid_prefix(d)
            certain = (not reads_draft_probs(r) or probs is None or keep == len(d) or r.text_drafted
                       or float(probs[i, keep, d[keep]]) >= 1.0)
            if keep < len(d) and not certain:
                own, one_hot_from = d[:keep + 1], keep + 1
            else:
                # the proposer's drafts keep their probabilities; copied text is one-hot from its first token
                own, one_hot_from = d[:keep], 0 if r.text_drafted else keep
                if keep == len(d) or not reads_draft_probs(r):
                    m.advance(own)
                    try:
                        own = own + m.forced(budget - len(fixed) - len(own))
                    finally:
                        m.rollback(keep)
        finally:
            m.rollback(len(fixed))
        own = own[:max(0, budget - len(fixed))]
        if not fixed and own == d and not r.text_drafted:
            continue
        changed = True
        tokens[i] = fixed + own
        same = _common(d, own)
        if proposer is not None and same < len(d) and not r.text_drafted:
            # The drafter cached tokens that are no longer drafted: it forgets them past the shared prefix.
            proposer.rollback(r, len(r.all_token_ids) + len(fixed) + same)
        if probs is not None and reads_draft_probs(r):
            if fixed:
                probs = _after_prefix(probs, i, fixed)
            if len(own) > one_hot_from:
                probs = one_hot_rows(probs, i, len(fixed) + one_hot_from, own[one_hot_from:])
    return Proposal(tokens, probs) if changed else prop


def _copied_text(m, request, prefix: list[int], budget: int, lookup) -> list[int]:
    """The phrase of the prompt the output is copying (``TextLookup``) and, where the phrase ends and the
    grammar allows it, the first of the lookup's string closers: a value copied into a JSON string ends with
    the phrase more often than not, and the target spells the quote and what follows as one token (``",``).
    Without a copy, after an object or array closed with no comma: the first bracket closer the grammar allows.
    ``m`` is in the state after ``prefix``."""
    phrase = lookup.propose(request, prefix, budget)
    if phrase is None:
        # An object or array the model closed without a comma after it is the last of its list: the lists
        # around it most likely close next (the model spells "another item follows" as `},` or `],`).
        if prefix or not request.text.endswith(("}", "]")):
            return []
        return _first_allowed(m, lookup.bracket_closers)
    if m.valid_prefix(phrase) < len(phrase) or len(phrase) >= budget:
        return phrase
    m.advance(phrase)
    try:
        return phrase + _first_allowed(m, lookup.string_closers)
    finally:
        m.rollback(len(phrase))


def _first_allowed(m, candidates: list[int]) -> list[int]:
    """The first of ``candidates`` the grammar allows next, as a one-token list (empty if none is)."""
    return next(([c] for c in candidates if m.valid_prefix([c])), [])


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _after_prefix(probs: torch.Tensor, i: int, prefix: list[int]) -> torch.Tensor:
    """probs with request i's rows moved back by len(prefix), and one-hot rows for the prefix before them."""
    n = len(prefix)
    probs = widened(probs, probs.shape[1] + n)
    probs[i, n:] = probs[i, :-n].clone()
    return one_hot_rows(probs, i, 0, prefix)


def mask_rows(request, rows: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
    """The request's verification logits [len(drafts) + 1, V] with tokens its grammar forbids at each row set
    to -inf (row j: the state after drafts[:j]). Unconstrained requests pass through unchanged."""
    m = matcher_of(request)
    if m is None:
        return rows
    allowed = m.allowed(list(drafts[:rows.shape[0] - 1])).to(rows.device)
    if not bool(allowed[0].any()):
        raise RuntimeError("The request's output constraint allows no token after this output: no text can "
                           "complete it from here.")
    n, V = rows.shape[0], min(rows.shape[-1], allowed.shape[-1])
    if request.params.greedy:
        # A greedy row only needs its argmax: where the model's own choice is allowed, masking changes nothing.
        top = argmax(rows)
        if bool((top < V).all()) and bool(allowed[torch.arange(n), top.clamp(max=V - 1)].all()):
            return rows
    keep = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
    keep[:, :V] = allowed[:n, :V]
    return torch.where(keep, rows.float(), float("-inf"))


def commit_token(request, token: int) -> bool:
    """Advance the request's grammar by a committed token; True when the grammar has terminated (its stop
    token was accepted), which ends the request."""
    m = matcher_of(request)
    if m is None:
        return False
    if not m.advance([token]):
        # Cannot happen for tokens drawn from masked rows; a loud error beats silently unconstrained output.
        raise RuntimeError(f"token {token} violates the request's grammar")
    if m.is_terminated():
        m.spellings.stop = token  # the stop token the model chose: drafted where a grammar ends (Matcher.forced)
        return True
    return False
