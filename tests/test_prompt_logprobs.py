"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``) and vLLM's ``Logprob`` objects, offline.

The reference is transformers' fp32 forward over the same prompt. The values must not depend on how the prompt
was computed: whole, in chunks, in a verification pass beside other requests' drafts, with speculation on or
off, or after another request put the same prefix in the cache (a request that wants its prompt's logprobs
computes every row itself)."""
from __future__ import annotations

import pytest
import torch

from specdecode import SamplingParams
from specdecode.outputs import Logprob

from helpers_spec import GREEDY, llm_cache, one_thread  # noqa: F401
from test_hf_parity import LOGITS_TOL, _hf_logits, _hf_model, _prompt


def _prompt_logprobs(llm, prompts: list[list[int]], top: int = 3, **kw) -> list:
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(prompt_logprobs=top, max_tokens=4, **GREEDY, **kw))
    return [o.prompt_logprobs for o in outs]


def test_prompt_logprobs_match_transformers_and_are_vllm_logprob_objects(tiny_models, llm_cache, one_thread):
    path = tiny_models["llama"]
    hf = _hf_model(path)
    ids = _prompt(hf.config.vocab_size, n=40)
    ref = torch.log_softmax(_hf_logits(hf, ids), -1)
    llm = llm_cache.get(path)
    [got] = _prompt_logprobs(llm, [ids], top=3)
    assert len(got) == len(ids) and got[0] is None
    tok = llm.get_tokenizer()
    for i in range(1, len(ids)):
        row, t = got[i], ids[i]
        assert isinstance(row[t], Logprob)
        assert abs(row[t].logprob - ref[i - 1, t].item()) < LOGITS_TOL
        above = ref[i - 1] > ref[i - 1, t]  # the rank counts the tokens more likely than it, give or take ties
        near = (ref[i - 1] - ref[i - 1, t]).abs() < LOGITS_TOL
        assert 1 + int((above & ~near).sum()) <= row[t].rank <= 1 + int((above | near).sum()) - int(near[t])
        assert row[t].decoded_token == tok.decode([t], skip_special_tokens=False)
        top = sorted(row.values(), key=lambda lp: lp.rank)[:3]
        assert [lp.rank for lp in top] == [1, 2, 3] and top[0].logprob >= top[1].logprob >= top[2].logprob
        assert top[0].logprob == pytest.approx(ref[i - 1].max().item(), abs=LOGITS_TOL)
        assert len(row) == 3 + (row[t].rank > 3)
    # sampled-token logprobs are Logprob objects too, with their rank
    out = llm.generate(prompt_token_ids=[ids], use_tqdm=False,
                       sampling_params=SamplingParams(logprobs=2, max_tokens=3, **GREEDY))[0].outputs[0]
    for t, row in zip(out.token_ids, out.logprobs):
        assert row[t].rank == 1 and isinstance(row[t].decoded_token, str)  # greedy: the top token
    assert out.cumulative_logprob == pytest.approx(sum(r[t].logprob for t, r in zip(out.token_ids, out.logprobs)))
    # none unless asked for
    plain = llm.generate(prompt_token_ids=[ids], use_tqdm=False,
                         sampling_params=SamplingParams(max_tokens=2, **GREEDY))[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_do_not_depend_on_how_the_prompt_was_computed(tiny_models, tiny_draft, llm_cache,
                                                                     one_thread):
    path = tiny_models["llama"]
    ids = _prompt(512, n=100, seed=3)
    other = _prompt(512, n=70, seed=4)
    [ref] = _prompt_logprobs(llm_cache.get(path, enable_prefix_caching=False), [ids])
    # speculation on, prefix caching on: the same prompt twice (the second would find it all in the cache),
    # then in 16-token chunks beside another request that decodes with drafts (its chunks ride in that pass)
    spec = llm_cache.get(path, speculative_model=str(tiny_draft), num_speculative_tokens=3)
    assert _prompt_logprobs(spec, [ids]) == [ref]
    again = spec.generate(prompt_token_ids=[ids], use_tqdm=False,
                          sampling_params=SamplingParams(prompt_logprobs=3, max_tokens=4, **GREEDY))[0]
    assert again.prompt_logprobs == ref and again.metrics.num_cached_tokens == 0
    # a request without prompt logprobs still finds that prompt in the cache
    cached = spec.generate(prompt_token_ids=[ids], use_tqdm=False,
                           sampling_params=SamplingParams(max_tokens=4, **GREEDY))[0]
    assert cached.metrics.num_cached_tokens > 0
    chunked = llm_cache.get(path, speculative_model=str(tiny_draft), num_speculative_tokens=3,
                            max_num_batched_tokens=16, enable_prefix_caching=False)
    both = chunked.generate(prompt_token_ids=[other, ids], use_tqdm=False, sampling_params=[
        SamplingParams(max_tokens=40, **GREEDY), SamplingParams(prompt_logprobs=3, max_tokens=4, **GREEDY)])
    assert both[1].prompt_logprobs == ref
    # n > 1: the prompt is scored once, and every sample's output carries the same
    outs = chunked.generate(prompt_token_ids=[ids], use_tqdm=False,
                            sampling_params=SamplingParams(n=2, prompt_logprobs=3, max_tokens=3, temperature=1.0,
                                                           seed=1))
    assert outs[0].prompt_logprobs == ref and len(outs[0].outputs) == 2


def test_prompt_logprobs_are_validated():
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
