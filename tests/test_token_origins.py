"""Per-token origins on the engine's outputs (CompletionOutput.token_origins / token_text_ends), and
SamplingParams(speculative_decoding=False): plain decoding for one request on a speculating engine."""
from __future__ import annotations

from collections import Counter

import pytest

from specdecode import SamplingParams
from specdecode.outputs import DRAFTED_ORIGINS, TOKEN_ORIGINS

from helpers_spec import GREEDY, PROMPTS, llm_cache, noisy_drafts, one_thread  # noqa: F401  (fixtures)

MAX_TOKENS = 24


def _run(llm, params):
    return llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)


def _check_consistent(out) -> Counter:
    """The origins of one finished output against its token ids, its text and its acceptance counters."""
    c, s = out.outputs[0], out.metrics.spec_decode
    assert len(c.token_origins) == len(c.token_ids) == len(c.token_text_ends)
    assert set(c.token_origins) <= set(TOKEN_ORIGINS)
    assert c.token_origins[0] == "target"  # the prefill's token: nothing was drafted for it
    counts = Counter(c.token_origins)
    # ignore_eos and max_tokens: no step was cut short, so every accepted draft and every step's own token is here
    assert sum(counts[o] for o in DRAFTED_ORIGINS) == s.num_accepted_tokens
    assert counts["bonus"] + counts["corrected"] == s.num_drafts
    ends = c.token_text_ends
    assert ends == sorted(ends) and ends[-1] == len(c.text)
    return counts


@pytest.mark.parametrize("method", ["draft", "ngram", "ngram_first"])
def test_origins_add_up_to_the_acceptance_counts(method, one_thread, llm_cache, tiny_models, noisy_drafts):
    kw = {"draft": dict(speculative_model=noisy_drafts["llama"], num_speculative_tokens=4),
          "ngram": dict(speculative_model="[ngram]", num_speculative_tokens=4),
          "ngram_first": dict(speculative_model=noisy_drafts["llama"], num_speculative_tokens=3,
                              speculative_ngram_first=True)}[method]
    llm = llm_cache.get(tiny_models["llama"], **kw)
    outs = _run(llm, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))
    total = Counter()
    for out in outs:
        total += _check_consistent(out)
    drafted = {o for o in total if o in DRAFTED_ORIGINS}
    assert drafted, total  # something was accepted, so the test saw accepted drafts
    assert drafted <= {"draft": {"draft"}, "ngram": {"lookup"}, "ngram_first": {"draft", "lookup"}}[method]
    assert total["corrected"] > 0  # and rejections
    if method == "ngram_first":
        assert drafted == {"draft", "lookup"}  # the repetitive prompt is looked up, the others drafted


def test_speculation_off_for_a_request_keeps_greedy_text(one_thread, llm_cache, tiny_models, noisy_drafts):
    llm = llm_cache.get(tiny_models["llama"], speculative_model=noisy_drafts["llama"], num_speculative_tokens=4)
    on = _run(llm, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))
    off = _run(llm, SamplingParams(max_tokens=MAX_TOKENS, speculative_decoding=False, **GREEDY))
    # in one batch with speculating requests too
    mixed = _run(llm, [SamplingParams(max_tokens=MAX_TOKENS, speculative_decoding=i % 2 == 0, **GREEDY)
                       for i in range(len(PROMPTS))])
    assert sum(o.metrics.spec_decode.num_accepted_tokens for o in on) > 0
    for a, b, m in zip(on, off, mixed):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids == m.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
        assert b.metrics.spec_decode.num_draft_tokens == 0
        assert set(b.outputs[0].token_origins) == {"target"}
        _check_consistent(m)
    assert all(m.metrics.spec_decode.num_draft_tokens == 0 for m in mixed[1::2])
    assert any(m.metrics.spec_decode.num_draft_tokens > 0 for m in mixed[0::2])


def test_text_ends_are_cut_at_a_stop_string(one_thread, llm_cache, tiny_models):
    llm = llm_cache.get(tiny_models["llama"], speculative_model="[ngram]", num_speculative_tokens=4)
    full = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY), use_tqdm=False)
    text = full[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    cut = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=MAX_TOKENS, stop=[stop], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == text[:text.index(stop)]
    assert len(cut.token_text_ends) == len(cut.token_ids) and cut.token_text_ends[-1] == len(cut.text)
    assert all(e <= len(cut.text) for e in cut.token_text_ends)


def test_speculative_decoding_must_be_a_bool():
    with pytest.raises(ValueError, match="speculative_decoding must be true or false"):
        SamplingParams(speculative_decoding="no")


def test_text_forced_by_a_grammar_is_marked(one_thread, llm_cache, tiny_models):
    from specdecode.sampling_params import StructuredOutputsParams

    llm = llm_cache.get(tiny_models["llama"], speculative_model="[ngram]", num_speculative_tokens=4)
    answer = "The quick brown fox jumps over the lazy dog."
    out = llm.generate(["Say it:"], SamplingParams(max_tokens=64, temperature=0.0,
                                                  structured_outputs=StructuredOutputsParams(choice=[answer])),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == answer
    assert "grammar" in c.token_origins and len(c.token_origins) == len(c.token_ids)
    drafted = sum(o in DRAFTED_ORIGINS for o in c.token_origins)
    assert 0 < drafted <= out.metrics.spec_decode.num_accepted_tokens
    assert c.token_text_ends[-1] == len(c.text)
