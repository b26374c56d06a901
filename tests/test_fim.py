"""Fill in the middle (specdecode.fim): the three tokens found by their spellings, the prompt built from ids, and
the same middle from ``LLM``, the server's ``suffix`` and ``generate --suffix``, with and without speculation."""
from __future__ import annotations

import httpx
import openai
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from specdecode import LLM, SamplingParams
from specdecode.fim import FimTokens, find_fim_tokens, fim_prompt_ids

CASES = [
    ("def is_prime(n):\n    ", "\n    return True\n\nprint(is_prime(7))\n"),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
     "\n\n    def pop(self):\n        return self.items.pop()\n"),
    ("def mean(xs):\n    \"\"\"Arithmetic mean of a non-empty list.\"\"\"\n    total = 0\n    for x in xs:\n",
     "    return total / len(xs)\n"),
]
GREEDY = SamplingParams(temperature=0, max_tokens=96)


def _word_tokenizer(extra: list[str], bos: str | None = None) -> PreTrainedTokenizerFast:
    """A real fast tokenizer over a few words, with an unk token (which answers every unknown token) and the
    given special tokens."""
    vocab = {w: i for i, w in enumerate(["<unk>", "a", "b", "def", "f"])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    if bos is not None:
        from tokenizers.processors import TemplateProcessing
        tok.add_special_tokens([bos])
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.add_special_tokens(extra)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=bos)


def test_tokens_are_found_by_spelling_and_never_by_the_unk_id():
    assert find_fim_tokens(_word_tokenizer([])) is None  # every spelling converts to <unk>'s id: not a match
    assert find_fim_tokens(_word_tokenizer(["<|fim_prefix|>", "<|fim_suffix|>"])) is None  # no middle token
    t = _word_tokenizer(["<fim_prefix>", "<fim_middle>", "<fim_suffix>"])
    fim = find_fim_tokens(t)
    assert fim == FimTokens(t.convert_tokens_to_ids("<fim_prefix>"), t.convert_tokens_to_ids("<fim_suffix>"),
                            t.convert_tokens_to_ids("<fim_middle>"))
    t = _word_tokenizer(["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"])
    assert find_fim_tokens(t).suffix == t.convert_tokens_to_ids("<｜fim▁hole｜>")


def test_prompt_is_prefix_suffix_middle_with_the_bos_the_tokenizer_adds():
    t = _word_tokenizer(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"], bos="<s>")
    fim = find_fim_tokens(t)
    bos, a, b, f = (t.convert_tokens_to_ids(x) for x in ("<s>", "a", "b", "f"))
    assert t.encode("a") == [bos, a]
    assert fim_prompt_ids(t, fim, [a, b], "f a") == [bos, fim.prefix, a, b, fim.suffix, f, a, fim.middle]
    plain = _word_tokenizer(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    pf = find_fim_tokens(plain)
    assert plain.encode("a") == [a] and fim_prompt_ids(plain, pf, [], "") == [pf.prefix, pf.suffix, pf.middle]


@pytest.fixture(scope="module")
def pair():
    """The default pair and preset, the middles of CASES with speculation, and the same without it."""
    llm = LLM(max_model_len=1024)
    prompts = [{"prompt": pre, "suffix": suf} for pre, suf in CASES]
    spec = llm.generate(prompts, GREEDY, use_tqdm=False)
    proposer = llm.engine.proposer
    try:
        llm.engine.proposer = None  # an engine built without speculation is in exactly this state
        plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.engine.proposer = proposer
    return llm, spec, plain


def test_default_pair_fills_the_middle_exactly_under_speculation(pair):
    llm, spec, plain = pair
    tok, fim = llm.engine.tokenizer, llm.engine.input_processor.fim_tokens
    assert fim == FimTokens(*(tok.convert_tokens_to_ids(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>",
                                                                     "<|fim_middle|>")))
    for (pre, suf), s, p in zip(CASES, spec, plain):
        assert list(s.prompt_token_ids) == [fim.prefix, *tok.encode(pre, add_special_tokens=False), fim.suffix,
                                            *tok.encode(suf, add_special_tokens=False), fim.middle]
        assert list(s.outputs[0].token_ids) == list(p.outputs[0].token_ids)
        # the model writes the middle and ends it: it does not run on into the suffix
        assert s.outputs[0].finish_reason == "stop", s.outputs[0].text
        assert suf.strip() not in s.outputs[0].text
    assert "return False" in spec[0].outputs[0].text and "total" in spec[2].outputs[0].text
    assert sum(o.metrics.spec_decode.num_accepted_tokens for o in spec) > 0
    assert all(o.metrics.spec_decode.num_drafts == 0 for o in plain)


def test_prompt_dicts_refuse_unknown_keys_by_name(pair):
    llm = pair[0]
    with pytest.raises(ValueError, match="'multi_modal_data'"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, GREEDY, use_tqdm=False)


def test_server_suffix_streamed_or_not_gives_the_offline_middle(pair):
    from test_server import serve

    from specdecode.entrypoints.openai.api_server import build_app

    llm, spec, _ = pair
    with serve(build_app(served_model_name="qwen", engine=llm.engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        (pre, suf), want = CASES[0], spec[0]
        r = client.completions.create(model="qwen", prompt=pre, suffix=suf, max_tokens=96, temperature=0)
        assert r.choices[0].text == want.outputs[0].text and r.choices[0].finish_reason == "stop"
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        chunks = client.completions.create(model="qwen", prompt=pre, suffix=suf, max_tokens=96, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
        # several prompts share the one suffix, as in OpenAI's API
        two = client.completions.create(model="qwen", prompt=[CASES[0][0], CASES[0][0] + "if n < 2:"], suffix=suf,
                                        max_tokens=96, temperature=0)
        assert two.choices[0].text == want.outputs[0].text and len(two.choices) == 2
        # token ids are the prefix as it is
        ids = llm.engine.tokenizer.encode(pre, add_special_tokens=False)
        r = client.completions.create(model="qwen", prompt=ids, suffix=suf, max_tokens=96, temperature=0)
        assert r.choices[0].text == want.outputs[0].text
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": pre, "suffix": suf, "echo": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo", bad.text
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": pre, "suffix": suf, "truncate_prompt_tokens": 5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens", bad.text
        # an empty suffix is no suffix: a plain completion
        r = httpx.post(f"{url}/v1/completions", json={"prompt": pre, "suffix": "", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_model_without_fim_tokens_refuses_suffix_by_name(tiny_models):
    from test_cli import assert_one_line_error, run_cli
    from test_server import serve

    from specdecode.entrypoints.openai.api_server import build_app

    model = str(tiny_models["llama"])
    with serve(build_app({"model": model, "max_model_len": 64}, "tiny")) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 2}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "suffix" and "fill in the middle" in err["message"], r.text
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60).status_code == 200
    assert_one_line_error(run_cli("generate", "-m", model, "-p", "a", "--suffix", "b", "-n", 2),
                          "--suffix: suffix asks to fill in the middle")
    assert_one_line_error(run_cli("generate", "-m", model, "-p", "a", "--suffix", "b", "--chat"), "drop --chat")
    assert_one_line_error(run_cli("generate", "-m", model, "--suffix", "b"), "give the text before it with -p or -f")


def test_generate_suffix_file_prints_prefix_middle_suffix(pair, tmp_path):
    from test_cli import run_cli

    (pre, suf), want = CASES[0], pair[1][0]
    before, after = tmp_path / "before.py", tmp_path / "after.py"
    before.write_text(pre, encoding="utf-8")
    after.write_text(suf, encoding="utf-8")  # its last newline is part of the suffix
    p = run_cli("generate", "-f", before, "--suffix-file", after, "-n", 96, "--echo", "-c", 1024)
    assert p.returncode == 0, p.stderr
    assert p.stdout == pre + want.outputs[0].text + suf + "\n"


def test_llm_chat_passes_tools_and_template_keywords(pair):
    """LLM.chat takes vLLM's tools and continue_final_message (the same engine as above)."""
    llm = pair[0]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    params = SamplingParams(temperature=0, max_tokens=4)
    out = llm.chat(msgs, params, use_tqdm=False, tools=tools)[0]
    assert '"get_weather"' in out.prompt and "get_weather" not in llm.chat(msgs, params, use_tqdm=False)[0].prompt
    code = msgs + [{"role": "assistant", "content": "```python\n"}]
    out = llm.chat(code, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n```python\n")
