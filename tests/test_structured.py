"""Structured outputs (specdecode/structured): constraints compile, outputs follow them, and speculation stays
exact under them (greedy: token for token the same as constrained plain decoding, computed here by an
independent loop over the target and xgrammar; sampling: a chi-square test against the masked target)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from fake_request import FakeRequest
from helpers_spec import llm_cache, one_thread, sharp_draft, sharp_target  # noqa: F401  (fixtures)
from test_sampling_distribution import ALPHA, chi2_pvalue, unseeded

from specdecode import SamplingParams
from specdecode.layers.sampler import logits_to_probs
from specdecode.structured import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

PROMPT = [17, 42, 99, 17, 42, 99, 17, 42]
MAX_TOKENS = 90
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "role": {"enum": ["admin", "user"]},
                                           "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 1}},
          "required": ["name", "age", "role", "tags"], "additionalProperties": False}
# Compact JSON: a random tiny model would otherwise spend its tokens on the whitespace JSON allows.
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{1,3}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe not", "n/a \"quoted\""]),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ("," item)? ")"\nitem ::= [0-9] | "x"'),
}
SPEC = {
    "none": {},
    "ngram": dict(speculative_model="[ngram]", num_speculative_tokens=4, ngram_prompt_lookup_min=1),
    "draft_model": "draft",
}


def _valid(kind: str, text: str) -> None:
    c = CONSTRAINTS[kind]
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(c.regex, text), text
    elif kind == "choice":
        assert text in c.choice, text
    else:
        assert re.fullmatch(r"\([a-c]{1,3}(,[0-9x])?\)", text), text


def _reference(model_dir, prompt: list[int], constraint: StructuredOutputsParams, max_tokens: int) -> list[int]:
    """Constrained plain greedy decoding without the engine: one target pass per token, xgrammar's own
    bitmask applied to the logits, argmax, until the grammar accepts the stop token or max_tokens."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from specdecode.engine.model_runner import ModelRunner
    from specdecode.models.loader import load_model

    runner = ModelRunner(load_model(model_dir, "float32", "cpu", 256, None), 1, 256, "cpu")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    V = runner.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[0])
    compiled = _compile(xgr.GrammarCompiler(info), constraint)
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, V)
    logits = runner.prefill(0, prompt)
    out: list[int] = []
    while len(out) < max_tokens and not m.is_terminated():
        m.fill_next_token_bitmask(bitmask)
        allowed = torch.tensor([(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(V)], dtype=torch.bool)
        t = int(torch.where(allowed, logits.float(), float("-inf")).argmax())
        assert m.accept_token(t)
        out.append(t)
        logits = runner.forward_rows([(0, len(prompt) + len(out) - 1, [t])], all_logits=True)[0][0]
    return out


def _compile(compiler, c: StructuredOutputsParams):
    if c.json is not None:
        return compiler.compile_json_schema(json.dumps(c.json), any_whitespace=not c.disable_any_whitespace)
    if c.regex is not None:
        return compiler.compile_regex(c.regex)
    if c.choice is not None:
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in c.choice))
    return compiler.compile_grammar(c.grammar)


@pytest.fixture(scope="module")
def engines(one_thread, llm_cache, sharp_target, sharp_draft):
    def get(spec: str):
        kw = SPEC[spec]
        if kw == "draft":
            kw = dict(speculative_model=sharp_draft, num_speculative_tokens=4)
        return llm_cache.get(sharp_target, max_model_len=256, **kw)
    return get


@pytest.fixture(scope="module")
def references(sharp_target):
    return {kind: _reference(sharp_target, PROMPT, c, MAX_TOKENS) for kind, c in CONSTRAINTS.items()}


@pytest.mark.parametrize("spec", list(SPEC))
def test_greedy_equals_constrained_plain_decoding(spec, engines, references):
    llm = engines(spec)
    kinds = list(CONSTRAINTS)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[k]) for k in kinds]
    outs = llm.generate(prompt_token_ids=[PROMPT] * len(kinds), sampling_params=params, use_tqdm=False)
    for kind, o in zip(kinds, outs):
        c = o.outputs[0]
        assert list(c.token_ids) == references[kind], f"{kind} with {spec}"
        assert c.finish_reason == "stop", f"{kind} with {spec}: unfinished {c.text!r}"
        _valid(kind, c.text)


def test_forced_tokens_are_drafted_without_speculation(engines, references):
    """Method none: the grammar's forced text ('{"name": "' after the prompt, the keys, the enum tails) is
    drafted at no model cost and verified like any draft."""
    llm = engines("none")
    stats = llm.engine.spec_stats
    before = stats.num_draft_tokens, stats.num_accepted_tokens
    out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["json"]))[0].outputs[0]
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert drafted >= len('{"name":"'), drafted
    assert accepted == drafted  # forced tokens are the only legal ones: the masked target always takes them
    assert list(out.token_ids) == references["json"]


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_sampled_outputs_follow_the_constraint(spec, engines):
    llm = engines(spec)
    kinds = list(CONSTRAINTS)
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=60, structured_outputs=CONSTRAINTS[k])
              for s in range(3) for k in kinds]
    outs = llm.generate(prompt_token_ids=[PROMPT] * len(params), sampling_params=params, use_tqdm=False)
    for p, o in zip(params, outs):
        kind = next(k for k, c in CONSTRAINTS.items() if c is p.structured_outputs)
        if o.outputs[0].finish_reason == "stop":
            _valid(kind, o.outputs[0].text)
        else:
            assert o.outputs[0].finish_reason == "length"


def test_seeded_constrained_text_is_the_same_with_and_without_speculation(engines):
    """A seeded request's tokens are its position noise's argmax under the grammar's mask, whatever the drafts
    (the drafter guesses with the same noise, and forbidden guesses are cut as for greedy requests)."""
    kinds = list(CONSTRAINTS)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=40, structured_outputs=CONSTRAINTS[k])
              for s in range(3) for k in kinds]
    texts = {spec: [o.outputs[0].token_ids for o in engines(spec).generate(
        prompt_token_ids=[PROMPT] * len(params), sampling_params=params, use_tqdm=False)] for spec in SPEC}
    assert texts["ngram"] == texts["none"] and texts["draft_model"] == texts["none"]
    assert len({tuple(t) for t in texts["none"]}) > len(kinds)  # the seeds give different texts


def test_unsatisfiable_within_max_tokens_ends_with_length(engines):
    llm = engines("ngram")
    out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="a{40}")))[0].outputs[0]
    assert out.finish_reason == "length" and out.text == "a" * 5


def test_grammar_termination_ends_the_request_even_with_ignore_eos(engines):
    llm = engines("none")
    out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json"),
    (dict(json='{"type": "object",'), "not valid JSON"),
    (dict(regex="(ab"), "regex"),
    (dict(grammar='root ::= "a" | ('), "grammar"),
    # constraints no text satisfies: refused when compiled, not a failure at the first token
    (dict(regex="[^\\s\\S]"), "no text satisfies it"),
    (dict(json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "no text satisfies it"),
])
def test_bad_constraints_are_value_errors(engines, kwargs, needle):
    llm = engines("none")
    with pytest.raises(ValueError, match=needle):
        llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(**kwargs)))
    assert not llm.engine.has_unfinished_requests()


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    p = SamplingParams(n=2, seed=1, structured_outputs=StructuredOutputsParams(json='{"type": "object"}'))
    assert p.clone(seed=2).structured_outputs is p.structured_outputs


def test_compiled_grammars_are_cached(engines):
    compiler = engines("none").engine.grammar_compiler
    a = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    assert compiler.compile(StructuredOutputsParams(regex="[0-9]+")) is a


def test_forced_text_is_split_as_the_model_split_it(engines):
    """Spellings: where the model rejected the tokenizer's split of forced text before its last token, the
    next time that text is forced it is drafted the model's way. A rejection at the last token (where the
    model's split follows the free text after it) and a token that is not a start of the text teach nothing."""
    from specdecode.structured.grammar import Spellings

    tok = engines("none").get_tokenizer()
    spellings = Spellings(tok)
    text = "quick brown"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 3 and spellings.split(text) == ids

    def token(piece: str) -> int:
        [t] = tok.encode(piece, add_special_tokens=False)
        return t
    spellings.learn(text, ids, 2, token(" "))  # at the last token
    spellings.learn(text, ids, 1, token("j"))  # not what the text says
    assert spellings.split(text) == ids
    spellings.learn(text, ids, 0, token("q"))
    split = spellings.split(text)
    assert split[0] == token("q") and split != ids and tok.decode(split) == text
    assert spellings.split("lazy " + text) == tok.encode("lazy " + text, add_special_tokens=False)

    # The engine's side: only a greedy request's token at a rejection is the model's own choice; a sampled
    # request's is a draw from the residual distribution and teaches nothing.
    from specdecode.structured.speculation import learn_spelling
    matcher = engines("none").engine.grammar_compiler.matcher(StructuredOutputsParams(regex="(quick brown)+"))
    for greedy in (False, True):
        r = FakeRequest(matcher=matcher, params=SamplingParams(temperature=0 if greedy else 0.8),
                        forced_text="quick brown")
        learn_spelling(r, ids, 0, [token("q")])
        assert (matcher.spellings.split(text) != ids) == greedy


def test_text_lookup_drafts_the_prompt_phrase_the_output_is_copying(engines):
    """TextLookup matches the output's last characters (with the step's forced prefix) in the prompt's text,
    whatever tokens spelled them, and drafts the rest of the prompt's phrase: up to its end, None without a
    match, nothing where the match ends the phrase."""
    from specdecode.speculative.text_lookup import TextLookup

    class Req:  # the request fields it reads (requests are weakly referenced, as the engine's are)
        def __init__(self, **kw):
            self.__dict__.update(kw)

    tok = engines("none").get_tokenizer()
    lookup = TextLookup(tok)
    prompt = "Countries: Denmark (capital Copenhagen), Eldoria; done"
    r = Req(prompt=prompt, prompt_token_ids=tok.encode(prompt, add_special_tokens=False), text='{"country": "Den')
    assert tok.decode(lookup.propose(r, [], 8)) == "mark"
    r.text = '{"country": "Eld'
    assert tok.decode(lookup.propose(r, [], 8)) == "oria"
    assert len(lookup.propose(r, [], 1)) == 1
    r.text = '{"country": "Denmark'
    assert lookup.propose(r, [], 8) == []
    r.text = '{"capital": "Co'
    assert lookup.propose(r, [], 8) is None  # two characters: too short to say what is copied
    assert tok.decode(lookup.propose(r, tok.encode("pen", add_special_tokens=False), 8)) == "hagen"
    r.text = '{"x": "Zzz'
    assert lookup.propose(r, [], 8) is None
    # Outside a quoted value's start, a match must be long: in prose, short ones are everywhere.
    r.text = "The capital"
    assert lookup.propose(r, [], 8) is None
    r.text = "As the memo said, Denmark (capital Cop"
    assert tok.decode(lookup.propose(r, [], 8)) == "enhagen"
    # the prompt given as token ids only
    r = Req(prompt=None, prompt_token_ids=tok.encode(prompt, add_special_tokens=False), text='["Eld')
    assert tok.decode(lookup.propose(r, [], 8)) == "oria"
    assert tok.encode('"', add_special_tokens=False)[0] in lookup.string_closers


EXTRACT = [
    ("Extract every country with its capital: Denmark's capital is Copenhagen; the capital of Argentina is "
     "Buenos Aires, and Kenya is governed from Nairobi. Answer as a JSON object.",
     {"type": "object", "properties": {"countries": {"type": "array", "items": {
         "type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
         "required": ["country", "capital"]}}}, "required": ["countries"]}),
    ("List the people and the organizations in this memo: Adamson Emerson, chief executive of Faraday, met "
     "Dieter Zetsche of Daimler AG in Berlin. Answer as a JSON object.",
     {"type": "object", "properties": {"people": {"type": "array", "items": {"type": "string"}},
                                       "organizations": {"type": "array", "items": {"type": "string"}}},
      "required": ["people", "organizations"]}),
]


def test_default_pair_copies_values_from_the_prompt_exactly(one_thread, monkeypatch):
    """The real default pair on extraction questions under their schemas: greedy output is constrained plain
    decoding's token for token with the default policy, and with prompt lookup alone, with and without the text
    lookup. Prompt lookup by token ids finds little here (the names come out split into other tokens than the
    prompt's), so the copied drafts raise the accepted drafts."""
    from specdecode import LLM
    import specdecode.structured.speculation as spec

    llm = LLM(max_model_len=1024)
    default = llm.engine.config.speculative
    convs = [[{"role": "user", "content": q}] for q, _ in EXTRACT]
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True)) for _, schema in EXTRACT]

    def run(spec_config):
        llm.engine.set_speculative(spec_config)
        llm.engine.reset_prefix_cache()
        stats = llm.engine.spec_stats
        accepted = stats.num_accepted_tokens
        outs = [llm.chat(c, p, use_tqdm=False)[0].outputs[0] for c, p in zip(convs, params)]
        return [list(o.token_ids) for o in outs], stats.num_accepted_tokens - accepted, [o.text for o in outs]

    plain, _, texts = run(None)
    assert "Copenhagen" in texts[0] and "Zetsche" in texts[1], texts
    assert run(default)[0] == plain
    lookup = {"method": "ngram", "num_speculative_tokens": 4}
    copied, with_copies, _ = run(lookup)
    monkeypatch.setattr(spec, "_copied_text", lambda *a: [])
    uncopied, without, _ = run(lookup)
    assert copied == plain and uncopied == plain
    assert with_copies >= without + 5, (with_copies, without)


def test_a_finished_grammar_forces_its_stop_token_and_closed_lists_guess_their_close(engines):
    """Where the grammar allows nothing but a stop token, forced() drafts one: the stop token the model last
    ended a constrained output with (learned at commit), else the first. After an object closed with no comma,
    with nothing to copy, the closer of the lists around it is drafted (`]}`), where the grammar allows it."""
    from specdecode.speculative.text_lookup import TextLookup
    from specdecode.structured.speculation import _copied_text, commit_token

    llm = engines("none")
    tok = llm.get_tokenizer()
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}, "required": ["xs"]}
    compiler = llm.engine.grammar_compiler
    m = compiler.matcher(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert m.advance(enc('{"xs": [{"n": 1}'))
    assert m.forced(4) == []  # `,` or `]` may follow

    class Req:
        prompt, prompt_token_ids, text = "no digits here", [], '{"xs": [{"n": 1}'
    lookup = TextLookup(tok)
    guess = _copied_text(m, Req(), [], 4, lookup)
    assert len(guess) == 1 and tok.decode(guess).startswith("]"), tok.decode(guess)
    assert m.advance(enc("]}"))
    stop = m.forced(4)
    assert stop == [0] and m.forced_text == ""
    assert commit_token(type("R", (), {"matcher": m})(), 0) and compiler.spellings.stop == 0
    Req.text = '{"xs": [{"n": 1},'
    n = compiler.matcher(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert n.advance(enc('{"xs": [{"n": 1},')) and _copied_text(n, Req(), [], 4, lookup) == []


# ---- sampling: the masked target distribution, exactly ----
LETTERS = StructuredOutputsParams(regex="[a-z]+")
N_SAMPLES = 2000
N_BROKEN = 400


def _masked_marginals(model_dir, params: SamplingParams, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """p(x1) and sum_x1 p(x1) p(x2 | x1) with every row masked by the grammar state before it, then the
    request's sampling transform (the engine's order: mask, then temperature / top-p)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from specdecode.engine.model_runner import ModelRunner
    from specdecode.models.loader import load_model

    runner = ModelRunner(load_model(model_dir, "float32", "cpu", 64, None), 1, 64, "cpu")
    V = runner.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(model_dir)), vocab_size=V,
                                              stop_token_ids=[0])
    m = xgr.GrammarMatcher(_compile(xgr.GrammarCompiler(info), LETTERS))
    bitmask = xgr.allocate_token_bitmask(1, V)

    def masked_probs(logits: torch.Tensor) -> torch.Tensor:
        m.fill_next_token_bitmask(bitmask)
        allowed = torch.tensor([(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(V)], dtype=torch.bool)
        return logits_to_probs(torch.where(allowed, logits.float(), float("-inf"))[None], [params])[0].double()

    p1 = masked_probs(runner.prefill(0, prompt))
    marg = torch.zeros_like(p1)
    for x1 in torch.nonzero(p1 > 1e-9).flatten().tolist():
        assert m.accept_token(x1)
        marg += p1[x1] * masked_probs(runner.forward_rows([(0, len(prompt), [x1])], all_logits=True)[0][0])
        m.rollback(1)
    return p1.numpy(), marg.numpy()


def _second_tokens(llm, params: SamplingParams, n: int, seed0: int) -> np.ndarray:
    sps = unseeded(params, n, seed0, max_tokens=3, structured_outputs=LETTERS)
    outs = llm.generate(prompt_token_ids=[PROMPT[:6]] * n, sampling_params=sps, use_tqdm=False)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    return np.bincount([o.outputs[0].token_ids[1] for o in outs], minlength=llm.engine.target.vocab_size)


@pytest.fixture(scope="module")
def k1_llm(one_thread, llm_cache, sharp_target, sharp_draft):
    return llm_cache.get(sharp_target, speculative_model=sharp_draft, num_speculative_tokens=1,
                         max_model_len=64, max_num_seqs=16)


def test_sampling_follows_the_masked_target(k1_llm, sharp_target, monkeypatch):
    """The 2nd token is the first one the rejection sampler emits, after one draft-model token that the grammar
    often forbids (it allows only lowercase-letter tokens): its law must be the masked target's marginal. The
    same test catches a verifier that skips the mask (outputs then leave the grammar, which the engine refuses:
    the refusal is lifted here to let the statistics see them)."""
    params = SamplingParams(temperature=0.7)
    _, marg = _masked_marginals(sharp_target, params, PROMPT[:6])
    stats = k1_llm.engine.spec_stats
    drafted0 = stats.num_draft_tokens
    second = _second_tokens(k1_llm, params, N_SAMPLES, seed0=0)
    assert stats.num_draft_tokens - drafted0 >= N_SAMPLES // 2
    pval = chi2_pvalue(second, marg)
    assert pval > ALPHA, f"2nd token under a grammar does not follow the masked target (p={pval:.2e})"

    import specdecode.engine.llm_engine as eng

    monkeypatch.setattr(eng, "mask_rows", lambda r, rows, d: rows)
    monkeypatch.setattr(eng, "commit_token", lambda r, t: False)
    broken = _second_tokens(k1_llm, params, N_BROKEN, seed0=10 ** 6)
    pval = chi2_pvalue(broken, marg)
    assert pval < ALPHA, f"a sampler that skips the mask went unnoticed (p={pval:.2e})"


# After its first letter this grammar forces "qz-" (the only legal continuation), then letters again.
FORCED = StructuredOutputsParams(regex="[a-z]qz-[a-z]+")


def _after_forced(model_dir, params: SamplingParams, prompt: list[int],
                  constraint: StructuredOutputsParams = FORCED) -> dict[int, tuple[list[int], np.ndarray]]:
    """Per first token x1 (with its masked probability p1(x1) > 0): the forced tokens after it, as the engine
    drafts them, and p1(x1) times the masked distribution of the token after them. Checks that each forced
    token is the only one its row allows, so that the engine's forced drafts are always accepted."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from specdecode.engine.model_runner import ModelRunner
    from specdecode.models.loader import load_model

    runner = ModelRunner(load_model(model_dir, "float32", "cpu", 64, None), 1, 64, "cpu")
    V = runner.vocab_size
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    m = xgr.GrammarMatcher(_compile(xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=V, stop_token_ids=[0])), constraint), max_rollback_tokens=-1)
    bitmask = xgr.allocate_token_bitmask(1, V)

    def allowed() -> torch.Tensor:
        m.fill_next_token_bitmask(bitmask)
        return torch.tensor([(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(V)], dtype=torch.bool)

    def masked_probs(logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(torch.where(allowed(), logits.float(), float("-inf"))[None], [params])[0].double()

    p1 = masked_probs(runner.prefill(0, prompt))
    out = {}
    for x1 in torch.nonzero(p1 > 1e-9).flatten().tolist():
        assert m.accept_token(x1)
        forced = tok.encode(m.find_jump_forward_string(), add_special_tokens=False)
        assert forced, "the grammar forces text after the first token"
        for t in forced:
            assert allowed().nonzero().flatten().tolist() == [t]
            assert m.accept_token(t)
        logits = runner.forward_rows([(0, len(prompt), [x1] + forced)], all_logits=True)[0][-1]
        out[x1] = forced, (p1[x1] * masked_probs(logits)).numpy()
        m.rollback(1 + len(forced))
    return out


def _tokens_after_forced(llm, params: SamplingParams, n: int, seed0: int, forced: dict, prompt: list[int] = PROMPT[:6],
                         constraint: StructuredOutputsParams = FORCED, max_tokens: int = 6) -> np.ndarray:
    sps = unseeded(params, n, seed0, max_tokens=max_tokens, structured_outputs=constraint)
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=sps, use_tqdm=False)
    picked = []
    for o in outs:
        ids = list(o.outputs[0].token_ids)
        f = forced[ids[0]][0]
        assert ids[1:1 + len(f)] == f
        picked.append(ids[1 + len(f)])
    return np.bincount(picked, minlength=llm.engine.target.vocab_size)


@pytest.fixture(scope="module")
def blunt_draft_llm(one_thread, llm_cache, sharp_target, tiny_models):
    """The sharp target with the tiny llama it was made from as the draft: its nearly uniform distributions are
    far from the target's, so a verifier that lets its tokens through shows at once. A given k is a fixed k
    (no adaptive k), so it drafts behind every forced text however often it is rejected."""
    return llm_cache.get(sharp_target, speculative_model=tiny_models["llama"], num_speculative_tokens=1,
                         max_model_len=64, max_num_seqs=16)


def test_sampling_after_forced_text_follows_the_masked_target(blunt_draft_llm, sharp_target, monkeypatch):
    """The engine drafts the forced "qz-" and the draft model drafts a token after it in the same step, so the
    token after "qz-" is the first one the rejection sampler emits after a draft-model token drawn behind
    forced text: its law must be the masked target's marginal. The same test catches a verifier that pairs the
    draft model's distribution with the wrong row (not moved behind the forced tokens' one-hot rows)."""
    params = SamplingParams(temperature=0.7)
    ref = _after_forced(sharp_target, params, PROMPT[:6])
    marg = sum(p for _, p in ref.values())
    llm = blunt_draft_llm
    import specdecode.engine.llm_engine as eng

    fit, behind = eng.constrain_proposal, []  # behind: per step with forced text, the drafts after it

    def constrain(reqs, prop, forced, budgets, proposer=None, text_lookup=None):
        out = fit(reqs, prop, forced, budgets, proposer, text_lookup)
        behind.extend(len(t) - len(f) for t, f in zip(out.tokens, forced) if f)
        return out
    monkeypatch.setattr(eng, "constrain_proposal", constrain)
    counts = _tokens_after_forced(llm, params, N_SAMPLES, 0, ref)
    assert len(behind) >= N_SAMPLES and sum(b > 0 for b in behind) >= 0.9 * len(behind), behind[:20]
    pval = chi2_pvalue(counts, marg)
    assert pval > ALPHA, f"the token after forced text does not follow the masked target (p={pval:.2e})"

    import specdecode.structured.speculation as spec

    def unmoved(probs: torch.Tensor, i: int, prefix: list[int]) -> torch.Tensor:
        # rows added for the prefix, but the draft's distribution left on row 0 (a forced token's row)
        return torch.cat([probs, probs.new_zeros(probs.shape[0], len(prefix), probs.shape[2])], 1)

    monkeypatch.setattr(spec, "_after_prefix", unmoved)
    broken = _tokens_after_forced(llm, params, N_BROKEN, 10 ** 6, ref)
    pval = chi2_pvalue(broken, marg)
    assert pval < ALPHA, f"draft distributions on the wrong rows went unnoticed (p={pval:.2e})"


# The prompt's text holds the quoted value '"qz-abcd"': once the grammar has forced '"qz-' (the start of a quoted
# value), the engine's text lookup drafts the rest of it. The n-gram proposer needs 5 matching tokens; the prompt's
# '9' before the quote is not the output's first letter, so it finds nothing to draft.
COPY_PROMPT = 'the 9"qz-abcd", then'
COPY_FORCED = StructuredOutputsParams(regex='[a-z]"qz-[a-z]+')


@pytest.fixture(scope="module")
def text_lookup_llm(one_thread, llm_cache, sharp_target):
    return llm_cache.get(sharp_target, speculative_model="[ngram]", num_speculative_tokens=4,
                         ngram_prompt_lookup_min=5, ngram_prompt_lookup_max=5, max_model_len=64, max_num_seqs=16)


def test_sampling_after_a_text_lookup_draft_follows_the_masked_target(text_lookup_llm, sharp_target, monkeypatch):
    """Behind forced text, a phrase copied from the prompt's text is drafted one-hot in the same step: the token
    after '"qz-' is accepted from it or resampled from the residual, and its law must be the masked target's
    marginal. The proposer's step here carries draft probabilities (as when another request of the batch drew
    draft-model tokens), so the copied tokens' rows must be made one-hot; a verifier that leaves them as the
    proposer's rows accepts the copy every time, which the same test catches."""
    llm = text_lookup_llm
    tok = llm.get_tokenizer()
    prompt = tok.encode(COPY_PROMPT, add_special_tokens=False)
    params = SamplingParams(temperature=0.7)
    ref = _after_forced(sharp_target, params, prompt, COPY_FORCED)
    marg = sum(p for _, p in ref.values())
    import specdecode.engine.llm_engine as eng
    import specdecode.structured.speculation as spec

    proposer, V = llm.engine.proposer, llm.engine.target.vocab_size

    def with_probs(reqs, budgets):
        prop = type(proposer).propose(proposer, reqs, budgets)
        return eng.Proposal(prop.tokens, torch.zeros(len(reqs), 1, V))
    monkeypatch.setattr(proposer, "propose", with_probs)
    copied = []

    def copy(m, r, prefix, budget, lookup):
        out = spec_copy(m, r, prefix, budget, lookup)
        copied.append(tok.decode(prefix + out))
        return out
    spec_copy = spec._copied_text
    monkeypatch.setattr(spec, "_copied_text", copy)

    def after_forced(n: int, seed0: int) -> np.ndarray:
        return _tokens_after_forced(llm, params, n, seed0, ref, prompt, COPY_FORCED, max_tokens=7)
    counts = after_forced(N_SAMPLES, 0)
    assert sum(c.startswith('"qz-a') for c in copied) >= N_SAMPLES, copied[:10]
    pval = chi2_pvalue(counts, marg)
    assert pval > ALPHA, f"the token after a copied draft does not follow the masked target (p={pval:.2e})"

    def pad_only(probs: torch.Tensor, i: int, start: int, toks: list[int]) -> torch.Tensor:
        need = start + len(toks) - probs.shape[1]
        return torch.cat([probs, probs.new_zeros(probs.shape[0], need, probs.shape[2])], 1) if need > 0 else probs
    monkeypatch.setattr(spec, "one_hot_rows", pad_only)
    broken = after_forced(N_BROKEN, 10 ** 6)
    pval = chi2_pvalue(broken, marg)
    assert pval < ALPHA, f"copied drafts paired with the proposer's rows went unnoticed (p={pval:.2e})"


# ---- the server, through the official openai client ----
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["ok", "none"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99}, "admin": {"type": "boolean"}},
        "required": ["id", "admin"]}}, "required": ["user"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9},
                                             "minItems": 1, "maxItems": 3}}, "required": ["xs"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]},
     "minItems": 1, "maxItems": 2},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "object", "properties": {"v": {"const": "fixed"}, "n": {"type": "integer", "minimum": 1,
                                                                     "maximum": 5}}, "required": ["v", "n"]},
    {"type": "object", "properties": {"x": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["x"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 2},
                                      "meta": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}},
                                               "required": ["level"]}}, "required": ["tags", "meta"]},
]


@pytest.fixture(scope="module")
def servers(one_thread, sharp_target, sharp_draft):
    import contextlib

    from test_server import serve

    from specdecode.entrypoints.openai.api_server import build_app

    base = {"model": str(sharp_target), "max_model_len": 512, "max_num_seqs": 4}
    configs = {"none": {}, "ngram": dict(SPEC["ngram"]),
               "draft_model": {"speculative_model": str(sharp_draft), "num_speculative_tokens": 4}}
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(serve(build_app({**base, **kw}, "tiny", None)))
               for name, kw in configs.items()}


def _client(url: str):
    import openai
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_server_response_format_json_schema(servers):
    """Every answer parses and validates against its schema; greedy answers are the same with n-gram and
    draft-model speculation as without."""
    answers = {}
    for name, url in servers.items():
        client = _client(url)
        for i, schema in enumerate(SCHEMAS):
            r = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Give example {i} as JSON."}],
                temperature=0, max_tokens=300,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                        "strict": True}})
            choice = r.choices[0]
            assert choice.finish_reason == "stop", (name, i, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)
            answers.setdefault(i, {})[name] = choice.message.content
    for i, by_spec in answers.items():
        assert len(set(by_spec.values())) == 1, (i, by_spec)


def test_server_vllm_fields_and_errors(servers):
    import httpx

    url = servers["ngram"]
    client = _client(url)
    r = client.completions.create(model="tiny", prompt="pick", max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    r = client.completions.create(model="tiny", prompt="code", max_tokens=10, temperature=0,
                                  extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", r.choices[0].text)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "obj"}], max_tokens=200,
                                       temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "s"}], max_tokens=20,
                                       temperature=0, extra_body={"structured_outputs": {"grammar": 'root ::= "ab" [c-d]'}})
    assert r.choices[0].message.content in ("abc", "abd")
    # streaming carries the constrained text
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "s"}],
                                            max_tokens=20, temperature=0, stream=True,
                                            extra_body={"guided_choice": ["north", "south"]})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) in ("north", "south")
    bad = [({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "json"),
           ({"guided_regex": "(ab"}, "regex"),
           ({"guided_grammar": 'root ::= "a" | ('}, "grammar"),
           ({"guided_choice": ["a"], "guided_regex": "b"}, "one output constraint"),
           ({"response_format": {"type": "json_schema"}}, "json_schema"),
           ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
            "would be ignored"),
           ({"guided_regex": "[^\\s\\S]"}, "no text satisfies it"),
           ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend")]
    for extra, needle in bad:
        resp = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4, **extra},
                          timeout=60)
        assert resp.status_code == 400, (extra, resp.text)
        assert needle in resp.json()["error"]["message"], (extra, resp.text)
    assert httpx.get(f"{url}/health").status_code == 200
