"""Proposers (one per file) behind one interface (proposer.py), and the factory the engine builds them with."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.config import SpeculativeConfig
    from specdecode.speculative.proposer import Proposer


def uses_draft_model(spec: "SpeculativeConfig | None") -> bool:
    """Whether ``spec`` drafts with a draft model (draft_model, or suffix decoding given a model)."""
    return spec is not None and (spec.method == "draft_model" or (spec.method == "suffix" and bool(spec.model)))


def build_proposer(spec: "SpeculativeConfig | None", draft_runner=None, target_vocab: int = 0, tokenizer=None,
                   eos_token_ids=(), shared: dict | None = None) -> "Proposer | None":
    """The proposer for ``spec`` (None or method "none": no speculation). Methods that run a draft model use
    ``draft_runner``, already loaded. ``shared`` holds what proposers over one draft model share (truncated
    heads, the ids each head keeps), so switching between configs costs nothing."""
    from specdecode.speculative.adaptive import AdaptiveK

    if spec is None or spec.method == "none":
        return None
    policy = AdaptiveK(spec.adaptive)
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        from specdecode.speculative.ngram import NgramProposer
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, k, policy)
    draft = None
    if uses_draft_model(spec):
        from specdecode.speculative.draft_model import DraftModelProposer
        from specdecode.speculative.draft_vocab import draft_head_ids

        if draft_runner is None:
            raise ValueError(f"speculative method {spec.method!r} with a draft model needs an engine loaded with "
                             "one; build the engine with this speculative config.")
        shared = shared if shared is not None else {}
        ids = shared.setdefault("head_ids", {})
        key = (spec.draft_vocab_size, str(spec.token_map))
        if key not in ids:
            ids[key] = draft_head_ids(spec, tokenizer, eos_token_ids, draft_runner.model.args.vocab_size)
        from specdecode.speculative.draft_model import DEFAULT_DRAFT_WINDOW
        window = DEFAULT_DRAFT_WINDOW if spec.draft_window is None else spec.draft_window
        draft = DraftModelProposer(draft_runner, target_vocab, spec.draft_p_min, ids[key], spec.draft_confidence,
                                   k, policy, heads=shared.setdefault("heads", {}), window=window)
    if spec.method == "suffix":
        from specdecode.speculative.suffix import SuffixProposer

        # With a draft model, a suffix match replaces the draft model's proposal, so it must be as long as
        # the hybrid's prompt lookups are by default (short matches predict worse than the draft model).
        suffix = SuffixProposer(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                                spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                                min_match=3 if draft is not None else 2, k=k if draft is None else spec.lookup_k,
                                policy=policy)
        if draft is None:
            return suffix
        from specdecode.speculative.hybrid import HybridProposer
        return HybridProposer(suffix, draft, k, spec.lookup_k, policy)
    if spec.ngram_first:
        from specdecode.speculative.hybrid import HybridProposer
        from specdecode.speculative.ngram import NgramProposer
        return HybridProposer(NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max), draft, k,
                              spec.lookup_k, policy)
    return draft
