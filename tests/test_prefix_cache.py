"""Paged KV blocks, automatic prefix caching, chunked prefill and preemption.

The property everything rests on: a prompt's keys, values and logits are bitwise the same whether it is
prefilled whole, in chunks, or after a prefix taken from the cache. So greedy outputs (and logprobs) are
identical with and without prefix caching, chunked prefill and speculation, alone or batched.
"""
from __future__ import annotations

import random

import pytest

from helpers_spec import GREEDY, one_thread  # noqa: F401  (fixture)
from specdecode import LLM, SamplingParams
from specdecode.engine.block_pool import BLOCK_SIZE, BlockPool, KVCacheFullError

FAMILIES = ("llama", "qwen2", "opt", "gpt2")


# ---------------------------------------------------------------- the pool alone
def test_pool_allocates_on_demand_and_frees():
    pool = BlockPool(7, num_slots=2, blocks_per_slot=4, device="cpu")
    pool.ensure(0, 17)  # two blocks
    assert pool.held(0) == 32 and pool.num_used_blocks == 2
    pool.ensure(1, 64)
    assert pool.num_free_blocks == 1
    with pytest.raises(KVCacheFullError):
        pool.ensure(0, 64)  # two more needed, one free
    with pytest.raises(ValueError, match="max_model_len"):
        pool.ensure(0, 65)  # beyond the slot's table
    pool.check_consistency()
    pool.free(1)
    pool.ensure(0, 64)
    assert pool.num_used_blocks == 4
    pool.free(0)
    assert pool.num_used_blocks == 0
    pool.check_consistency()


def test_pool_full_raises_and_takes_nothing():
    pool = BlockPool(3, num_slots=2, blocks_per_slot=4, device="cpu")
    pool.ensure(0, 32)
    with pytest.raises(KVCacheFullError):
        pool.ensure(1, 33)  # needs 3, 1 free
    assert pool.held(1) == 0 and pool.num_free_blocks == 1
    pool.check_consistency()


def test_prefix_blocks_are_shared_exactly_and_evicted_last_released_last():
    pool = BlockPool(6, num_slots=2, blocks_per_slot=4, device="cpu")
    toks = list(range(100, 148))  # three blocks
    pool.ensure(0, 48)
    pool.register(0, toks, 48, draft_tokens=16)
    mine = list(pool.block_table[0, :3].tolist())
    blocks, draft = pool.match(toks, 47)  # at most 47 positions: two whole blocks
    assert blocks == mine[:2] and draft == 1
    other = toks[:16] + [0] + toks[17:]  # differs in the second block: only the first is shared
    assert pool.match(other, 48)[0] == mine[:1]
    pool.attach(1, mine[:2])
    pool.free(0)  # block 3 of slot 0 is registered: it stays cached, unreferenced
    assert pool.num_used_blocks == 2 and pool.num_cached_blocks == 3
    pool.free(1)
    pool.check_consistency()
    # taking fresh blocks uses never-used ones first, then evicts the least recently released
    pool.ensure(0, 64)
    assert pool.num_cached_blocks == 2
    assert pool.match(toks, 48)[0] == mine[:2]
    pool.check_consistency()


def test_past_the_resident_cap_cached_blocks_are_reused_before_never_written_ones():
    """A pool with room for long contexts keeps RAM bounded: once resident_blocks distinct blocks were written,
    a new block comes from the oldest cached one, not from untouched address space; running sequences still
    get every block they need."""
    pool = BlockPool(16, num_slots=2, blocks_per_slot=8, device="cpu", resident_blocks=4)
    for i in range(3):  # three different cached prompts of two blocks each
        pool.ensure(0, 32)
        pool.register(0, [100 * i + t for t in range(32)], 32, 0)
        pool.free(0)
    assert pool.touched == 4 and pool.num_cached_blocks == 4  # the third prompt evicted the first one
    assert pool.match([t for t in range(32)], 32)[0] == []
    assert len(pool.match([200 + t for t in range(32)], 32)[0]) == 2
    pool.ensure(1, 128)  # a sequence longer than the cap: it gets its blocks, touching new ones
    assert pool.held(1) == 128 and pool.touched == 8
    pool.check_consistency()


def test_disabled_prefix_caching_registers_nothing():
    pool = BlockPool(4, num_slots=1, blocks_per_slot=4, device="cpu", enable_prefix_caching=False)
    pool.ensure(0, 32)
    pool.register(0, list(range(32)), 32, 32)
    pool.free(0)
    assert pool.num_cached_blocks == 0 and pool.match(list(range(32)), 31) == ([], 0)


def test_a_partly_filled_block_is_found_by_its_tokens_so_far_and_dropped_when_evicted():
    pool = BlockPool(4, num_slots=2, blocks_per_slot=4, device="cpu")
    toks = list(range(100, 140))  # two whole blocks and 8 positions of a third
    pool.ensure(0, 40)
    pool.register(0, toks, 40, draft_tokens=0)
    mine = pool.blocks(0)
    blocks, _ = pool.match(toks + [1], 40)
    assert blocks == mine[:2]
    assert pool.match_partial(toks[:37] + [0, 0], blocks, 39) == (mine[2], 5)  # shares 5 of its 8 positions
    assert pool.match_partial(toks, blocks, 39) == (mine[2], 7)  # never past max_tokens
    assert pool.match_partial([0] + toks[1:], [], 39) is None  # another first block: another parent
    pool.free(0)
    pool.check_consistency()
    assert pool.num_free_blocks == 4 and pool.match_partial(toks, blocks, 39) == (mine[2], 7)  # kept, evictable
    pool.ensure(1, 64)  # takes every block: the partial entry goes with its block
    assert pool.match_partial(toks, pool.match(toks, 39)[0], 39) is None
    assert pool.partial_in_draft(mine[2]) == 0
    pool.free(1)
    pool.check_consistency()


def test_a_partly_filled_block_records_how_much_of_it_the_draft_holds():
    pool = BlockPool(4, num_slots=2, blocks_per_slot=4, device="cpu")
    toks = list(range(100, 140))
    pool.ensure(0, 40)
    pool.register(0, toks, 40, draft_tokens=37)  # the draft saw 5 of the third block's 8 positions
    third = pool.blocks(0)[2]
    assert pool.partial_in_draft(third) == 5
    pool.register(0, toks, 40, draft_tokens=40)  # registered again once the draft caught up
    assert pool.partial_in_draft(third) == 8
    pool.ensure(1, 16)
    pool.register(1, [7] * 16, 16, draft_tokens=30)  # no partly filled block: nothing recorded
    pool.free(0)
    pool.free(1)
    pool.check_consistency()


# ---------------------------------------------------------------- the engine
def _llm(path, **kw):
    return LLM(model=str(path), max_model_len=512, seed=0, **kw)


def _run(llm, prompts, max_tokens=12, logprobs=None):
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **GREEDY))
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _prompts(seed: int, shared: int, n: int, tail: int) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(5, 500) for _ in range(shared)]
    return [head + [rng.randrange(5, 500) for _ in range(tail + 3 * i)] for i in range(n)]


@pytest.mark.parametrize("fam", FAMILIES)
def test_cache_hits_and_chunks_give_bitwise_the_same_logprobs(fam, tiny_models, one_thread):
    prompts = _prompts(1, shared=70, n=3, tail=9)
    ref_llm = _llm(tiny_models[fam], enable_prefix_caching=False, max_num_batched_tokens=4096,
                   speculative_config={"method": "none"})
    ref = [_run(ref_llm, [p], logprobs=3)[0] for p in prompts]
    llm = _llm(tiny_models[fam], max_num_batched_tokens=32, speculative_config={"method": "none"})
    first = _run(llm, [prompts[0]], logprobs=3)[0]
    pool = llm.llm_engine.pool
    assert pool.hits == 0
    later = [_run(llm, [p], logprobs=3)[0] for p in prompts[1:]]
    assert pool.hits >= 2 * 64, "the shared 70-token head (4 whole blocks) must come from the cache"
    assert [first] + later == ref  # token ids and every logprob, bitwise
    pool.check_consistency()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("fam", FAMILIES)
def test_prompts_arriving_together_prefill_in_one_pass_and_compute_their_common_head_once(fam, tiny_models,
                                                                                          one_thread):
    """Prompts that arrive together are prefilled in one target pass, each as if alone (bitwise the same
    logprobs); one whose next block another prompt of the pass computes from the same tokens waits a step and
    takes that block from the cache instead."""
    prompts = _prompts(4, shared=70, n=4, tail=9)
    ref_llm = _llm(tiny_models[fam], enable_prefix_caching=False, speculative_config={"method": "none"})
    ref = [_run(ref_llm, [p], logprobs=3)[0] for p in prompts]
    llm = _llm(tiny_models[fam], max_num_seqs=4, max_num_batched_tokens=4096, speculative_config={"method": "none"})
    target = llm.llm_engine.target
    passes: list[tuple[str, int]] = []  # (kind of pass, prompt chunks it computed)

    def chunks_in(seqs):
        return sum(any(start + len(toks) <= len(p) and p[start:start + len(toks)] == toks for p in prompts)
                   for _, start, toks in seqs)

    prefill_many, forward_rows = target.prefill_many, target.forward_rows
    target.prefill_many = lambda seqs, *a: passes.append(("prefill", chunks_in(seqs))) or prefill_many(seqs, *a)
    target.forward_rows = lambda seqs, **kw: passes.append(("rows", chunks_in(seqs))) or forward_rows(seqs, **kw)
    assert _run(llm, prompts, logprobs=3) == ref
    # the three prompts that waited for the shared head share a pass; where prompt rows take the decode rows'
    # path, that pass is the first prompt's first decode step
    joined = llm.llm_engine.target.chunks_start_anywhere
    assert (("rows" if joined else "prefill"), 3) in passes, passes
    assert [kind for kind, n in passes if n] == ["prefill"] + ["rows" if joined else "prefill"], passes
    pool = llm.llm_engine.pool
    # the 70-token head is computed once and taken by the other three: its 4 whole blocks, and its last 6
    # positions too where a chunk may start inside a block
    assert pool.hits == 3 * (70 if llm.llm_engine.target.chunks_start_anywhere else 64)
    pool.check_consistency()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("fam", FAMILIES)
def test_an_exact_repeat_computes_only_its_last_token_where_chunks_start_anywhere(fam, tiny_models, one_thread):
    """llama-server's slot cache: a prompt sent again finds all of it but its last token, also the positions
    of its last, partly filled block (copied out of the first request's block), and gives bitwise the same
    logprobs. Where the model's prefill is exact only for whole blocks, the partly filled block is computed."""
    prompt = _prompts(5, shared=0, n=1, tail=45)[0]  # 2 whole blocks and 13 positions
    ref = _run(_llm(tiny_models[fam], enable_prefix_caching=False, speculative_config={"method": "none"}),
               [prompt], logprobs=3)[0]
    llm = _llm(tiny_models[fam], speculative_config={"method": "none"})
    assert _run(llm, [prompt], logprobs=3)[0] == ref
    pool = llm.llm_engine.pool
    assert pool.hits == 0
    assert _run(llm, [prompt], logprobs=3)[0] == ref
    anywhere = llm.llm_engine.target.chunks_start_anywhere
    assert anywhere == (fam in ("llama", "qwen2"))  # the families the C++ layer stack covers
    assert pool.hits == (len(prompt) - 1 if anywhere else 32)
    pool.check_consistency()
    assert pool.num_used_blocks == 0


def test_a_hit_on_part_of_a_block_covers_the_drafts_cache_too(tiny_models, tiny_draft, one_thread):
    """A shared head of 2 whole blocks and 8 positions (a system prompt): the next request's draft starts after
    all 40 of them, the last 8 copied out of the first request's partly filled block, and the output is the
    same as without the cache."""
    rng = random.Random(11)
    head = [rng.randrange(5, 500) for _ in range(40)]
    second = head + [rng.randrange(5, 500) for _ in range(10)]
    spec = {"method": "draft_model", "model": str(tiny_draft), "num_speculative_tokens": 4}
    ref = _run(_llm(tiny_models["llama"], enable_prefix_caching=False, speculative_config=spec), [second])[0]
    llm = _llm(tiny_models["llama"], speculative_config=spec)
    _run(llm, [head], max_tokens=4)  # its blocks: 2 whole, then head[32:] and its answer in a third
    fed = []  # (start, tokens) of each draft pass
    runner = llm.llm_engine.draft_runner
    forward = runner._pass
    runner._pass = lambda seqs, *a, **k: (fed.append((seqs[0][1], len(seqs[0][2]))), forward(seqs, *a, **k))[1]
    assert _run(llm, [second])[0] == ref
    assert fed[0] == (40, 11)  # the tail and the first output token; without the partial block: (32, 19)
    llm.llm_engine.pool.check_consistency()


@pytest.mark.parametrize("spec", [{"method": "none"}, {"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 4}])
@pytest.mark.parametrize("quantization", ["none", "w8a8", "w4a8"])
def test_a_next_turn_reuses_the_answers_blocks_bitwise(spec, quantization, tiny_models, tiny_draft, one_thread):
    """A chat's next turn re-sends the previous answer: the blocks decode steps (and verifications) wrote for
    it come from the cache, and every logprob of the next turn is bitwise what a cold engine gives."""
    if spec.get("model") == "DRAFT":
        spec = dict(spec, model=str(tiny_draft))
    first = _prompts(3, shared=0, n=1, tail=20)[0]
    ref_llm = _llm(tiny_models["llama"], enable_prefix_caching=False, speculative_config={"method": "none"},
                   quantization=quantization)
    answer = _run(ref_llm, [first], max_tokens=40)[0][0]
    turn2 = first + answer + [7, 8, 9, 10, 11]
    ref = _run(ref_llm, [turn2], logprobs=3)[0]
    llm = _llm(tiny_models["llama"], speculative_config=spec, quantization=quantization)
    assert _run(llm, [first], max_tokens=40)[0][0] == answer
    pool = llm.llm_engine.pool
    hits = pool.hits
    assert _run(llm, [turn2], logprobs=3)[0] == ref
    assert pool.hits - hits >= 16 * ((len(first) + len(answer) - 1) // 16), "the answer's full blocks were reused"
    pool.check_consistency()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 4}])
def test_greedy_identical_with_and_without_caching_chunking_and_speculation_batched(spec, tiny_models, tiny_draft,
                                                                                  one_thread):
    if spec.get("model") == "DRAFT":
        spec = dict(spec, model=str(tiny_draft))
    prompts = _prompts(2, shared=40, n=8, tail=5)
    prompts += [p[:] for p in prompts[:2]]  # exact repeats: the whole prompt but its last block is cached
    ref_llm = _llm(tiny_models["llama"], enable_prefix_caching=False, max_num_batched_tokens=4096,
                   speculative_config={"method": "none"})
    ref = [x[0] for x in _run(ref_llm, prompts, max_tokens=20)]
    for batched in (False, True):
        llm = _llm(tiny_models["llama"], max_num_batched_tokens=16, max_num_seqs=8, speculative_config=spec)
        got = ([x[0] for x in _run(llm, prompts, max_tokens=20)] if batched
               else [_run(llm, [p], max_tokens=20)[0][0] for p in prompts])
        assert got == ref, f"batched={batched}"
        assert llm.llm_engine.pool.hits > 0
        assert llm.llm_engine.pool.num_used_blocks == 0


def test_preemption_when_the_cache_is_short_finishes_every_request(tiny_models, one_thread):
    # Room for 128 positions only (one max-length sequence): 4 requests of ~100 tokens must take turns.
    model = tiny_models["llama"]
    probe = _llm(model, max_num_seqs=1, speculative_config={"method": "none"})
    per_block = probe.llm_engine.target.kv_cache.bytes_per_token * BLOCK_SIZE
    del probe
    llm = LLM(model=str(model), max_model_len=128, max_num_seqs=4, seed=0, kv_cache_memory=8 * per_block / 2 ** 30,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    prompts = _prompts(3, shared=0, n=4, tail=30)
    outs = _run(llm, prompts, max_tokens=60)
    assert all(len(ids) == 60 for ids, _ in outs)
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0
    eng.pool.check_consistency()
    assert eng.pool.num_used_blocks == 0


def test_kv_budget_below_one_sequence_is_a_clear_error(tiny_models):
    with pytest.raises(ValueError, match="kv_cache_memory=1e-06 GiB cannot hold one sequence"):
        LLM(model=str(tiny_models["llama"]), max_model_len=512, kv_cache_memory=1e-6)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 16"):
        LLM(model=str(tiny_models["llama"]), max_num_batched_tokens=8)


# ---------------------------------------------------------------- a real server
def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def server(tiny_models):
    from specdecode.entrypoints.openai.api_server import build_app
    from test_server import serve

    app = build_app({"model": str(tiny_models["llama"]), "speculative_model": "[ngram]", "num_speculative_tokens": 3,
                     "max_model_len": 512, "max_num_seqs": 8, "max_waiting_requests": 64,
                     "max_num_batched_tokens": 64}, "tiny", None)
    with serve(app) as url:
        yield url, app.state.engine.engine


def _stream(url: str, prompt: str, max_tokens: int, close_after_first: bool) -> str:
    import json

    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            text.append(ev["choices"][0]["text"])
            if close_after_first:
                break  # leaving the with-block closes the connection mid-stream
    return "".join(text)


def _idle(engine, timeout: float = 60.0) -> None:
    import time

    deadline = time.time() + timeout
    while engine.has_unfinished_requests():
        assert time.time() < deadline, "the engine did not drain"
        time.sleep(0.05)


def test_abort_storm_leaks_no_blocks(server):
    from concurrent.futures import ThreadPoolExecutor

    url, engine = server
    prompts = [f"storm request {i} shares a long system prompt: " + "lorem ipsum dolor sit amet " * 8
               for i in range(24)]
    rss = []
    for _ in range(3):
        with ThreadPoolExecutor(24) as ex:
            futs = [ex.submit(_stream, url, p, 48, i % 3 != 0) for i, p in enumerate(prompts)]  # 16 of 24 close
            done = [f.result(timeout=180) for f in futs]
        assert all(done[i] for i in range(0, 24, 3))
        _idle(engine)
        assert engine.pool.num_used_blocks == 0, "blocks still referenced after every request ended"
        engine.pool.check_consistency()
        rss.append(_rss_bytes())
    assert engine.pool.hits > 0
    # Same work each round: the process must not keep growing (cached blocks are bounded by the pool).
    assert rss[2] - rss[0] < 64 * 2 ** 20, rss


def test_prefix_cache_metrics_and_identical_repeat(server):
    import re

    import httpx

    url, engine = server
    prompt = "A long shared history that the second request repeats word for word. " * 4
    a = _stream(url, prompt, 24, False)
    q0, h0 = engine.pool.queries, engine.pool.hits
    b = _stream(url, prompt, 24, False)
    assert a == b
    assert engine.pool.hits - h0 >= (engine.pool.queries - q0) - 16, "all but the last block from the cache"
    text = httpx.get(f"{url}/metrics").text
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total"):
        assert re.search(rf'^{name}{{model_name="tiny"}} [0-9.e+]+$', text, re.M), name
    hits = float(re.search(r'^vllm:prefix_cache_hits_total{model_name="tiny"} ([0-9.e+]+)$', text, re.M).group(1))
    assert hits == engine.pool.hits
