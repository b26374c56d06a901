"""The tokenizer specdecode serves with (tokenizers + jinja2, no transformers) against transformers' tokenizer
of the same saved files: the same ids, text, special tokens and rendered chat templates."""
from __future__ import annotations

import random
import subprocess
import sys

import jinja2
import pytest

from specdecode.chat_template import render
from specdecode.models.default_models import default_model_path
from specdecode.models.gguf_tokenizer import load_gguf_tokenizer
from specdecode.tokenizer import SavedTokenizer, apply_chat_template, hf_tokenizer

TEXTS = [
    "", " ", "hello world", "Hello,  World!\n\n", "def f(x):\n\treturn x ** 2  # square\n",
    "Café, naïve, 日本語, 한국어, Ελληνικά — ok?  ", "emoji 🙂👍🏽 and a ZWJ 👩‍👩‍👧", "\u00a0\u2003tabs\t\tand nbsp",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>x<|endoftext|>", "<|im_start",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "1234567890 3.14159 -42", "a" * 300,
    # past SavedTokenizer._LONG_TEXT: split without holding the GIL, to the same ids
    "<|im_start|>user\n" + "Café 🙂 def f(x):\n\treturn x ** 2  # 日本語\n" * 700 + "<|im_end|>",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Städte, 東京"}},
                   "required": ["city"]}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about rain."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
     {"role": "tool", "tool_call_id": "c2", "content": "sunny"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "42", "reasoning_content": "6 * 7", "name": None},
     {"role": "user", "content": "<|im_start|> in user text"}],
]


@pytest.fixture(scope="module", params=["target", "draft"])
def pair(request):
    path = default_model_path(request.param)
    load_gguf_tokenizer(path)  # makes sure the saved folder exists
    tok = load_gguf_tokenizer(path)
    assert isinstance(tok, SavedTokenizer), "the saved default tokenizers must load without transformers"
    return tok, tok.hf


def test_encode_decode_and_vocabulary_match_transformers(pair):
    tok, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    special_ids = sorted(tok.added_tokens_decoder)
    for n in (1, 2, 7, 40):
        for _ in range(20):
            ids = [rng.choice(special_ids) if rng.random() < 0.2 else rng.randrange(len(tok)) for _ in range(n)]
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
            assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
            assert tok.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
                hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert tok.decode(special_ids[0]) == hf.decode(special_ids[0])
    import torch
    ids = torch.tensor([9707, 11, 1879, 0])  # tensors and numpy integers decode as transformers' do
    assert tok.decode(ids) == hf.decode(ids) == tok.decode(ids.numpy()) == tok.decode([int(i) for i in ids])
    assert tok.get_vocab() == hf.get_vocab() and len(tok) == len(hf) and tok.vocab_size == hf.vocab_size
    assert tok.added_tokens_decoder.keys() == hf.added_tokens_decoder.keys()
    assert tok.special_tokens_map == hf.special_tokens_map
    assert tok.all_special_ids == hf.all_special_ids and tok.all_special_tokens == hf.all_special_tokens
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) == getattr(hf, name)
        assert getattr(tok, name + "_id") == getattr(hf, name + "_id")
    assert tok.convert_tokens_to_ids(["<|im_end|>", "hello"]) == hf.convert_tokens_to_ids(["<|im_end|>", "hello"])
    assert (tok.model_max_length, tok.chat_template, tok.name_or_path) == \
        (hf.model_max_length, hf.chat_template, hf.name_or_path)


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_renders_as_transformers_does(pair, conv):
    tok, hf = pair
    messages = CONVERSATIONS[conv]
    for tools in (None, TOOLS):
        for gen in (True, False):
            for extra in ({}, {"enable_thinking": False}):
                ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False,
                                               **extra)
                assert ours == hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen,
                                                      tokenize=False, **extra)
    # tokenize=True (transformers' default) is transformers' own answer
    assert tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == \
        hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


CUSTOM = """{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}\
{% endif %}{% set ns.n = ns.n + 1 %}
  {%- generation %}[{{ m.role }}]{{ m.content | tojson(indent=2) }}{% endgeneration %}
{% if m.reasoning_content is defined %}R={{ m.reasoning_content }}|{{ m.thinking }}{% endif %}
{% if 'name' in m %}N{% endif %}
{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}{{ strftime_now('%Y') }}{% if tools %}{{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}<gen>{% endif %}{% if fail is defined %}{{ raise_exception('bad: ' ~ fail) }}{% endif %}"""


def test_template_features_match_transformers(pair):
    """Trimmed blocks, namespaces, loop controls, {% generation %}, tojson without HTML escaping, reasoning
    aliases, None keys dropped, special tokens as variables, raise_exception's error type."""
    tok, hf = pair
    messages = [{"role": "user", "content": "<b>&'\"ü"}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": {"k": [1, 2.5, None, True]}, "thinking": "hmm", "name": None},
                {"role": "user", "content": "y", "name": "bob"}]
    for gen in (True, False):
        ours = render(CUSTOM, messages, tools=TOOLS, add_generation_prompt=gen, special_tokens=tok.special_tokens_map)
        assert ours == hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=gen, tokenize=False,
                                              chat_template=CUSTOM)
    assert "R=hmm|hmm" in ours and '"<b>&\'\\"ü"' in ours
    # a keyword overrides a special token, as in transformers
    assert render(CUSTOM, messages, special_tokens=tok.special_tokens_map, bos_token="B").startswith("B")
    with pytest.raises(jinja2.TemplateError, match="bad: 1"):
        render(CUSTOM, messages, special_tokens=tok.special_tokens_map, fail=1)
    with pytest.raises(jinja2.TemplateError, match="bad: 1"):
        hf.apply_chat_template(messages, tokenize=False, chat_template=CUSTOM, fail=1)
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([], tokenize=False)
    sneaky = "{% set ns = namespace() %}{% set ns._x = 1 %}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        render(sneaky, messages)
    assert messages[2]["name"] is None  # the caller's messages are untouched


def test_transformers_is_built_only_when_asked():
    """Loading the default tokenizer and serving chat through it never imports transformers; xgrammar and
    get_tokenizer() get transformers' object of the same files."""
    code = (
        "import sys\n"
        "from specdecode.models.default_models import default_model_path\n"
        "from specdecode.tokenizer import load_tokenizer, hf_tokenizer\n"
        "tok = load_tokenizer(default_model_path('target'), True)\n"
        "text = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,"
        " add_generation_prompt=True)\n"
        "ids = tok.encode(text); tok.decode(ids); tok.get_vocab(); tok.eos_token_id\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "hf = hf_tokenizer(tok)\n"
        "assert 'transformers' in sys.modules and hf.encode(text) == ids and hf is tok.hf\n"
        "print(type(hf).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("TokenizersBackend", "PreTrainedTokenizerFast")


def test_a_config_with_more_than_tokens_falls_back_to_transformers():
    assert SavedTokenizer.usable({"tokenizer_class": "TokenizersBackend", "eos_token": "</s>"})
    for config in ({"tokenizer_class": "LlamaTokenizer"}, {"add_bos_token": True},
                   {"clean_up_tokenization_spaces": True}, {"eos_token": {"content": "</s>"}},
                   {"backend": "sentencepiece"}):
        assert not SavedTokenizer.usable(config), config
    assert hf_tokenizer("x") == "x"


def test_bench_serve_counts_a_chat_prompt_in_tokens(pair):
    """Without a usage block, `bench serve` counts a chat prompt as the rendered template's tokens
    (transformers 5's tokenize=True returns a dict, whose length is its number of keys)."""
    from specdecode.bench.serve.client import _count_prompt

    tok, hf = pair
    messages = CONVERSATIONS[1]
    want = len(hf.encode(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False))
    assert want > 20
    assert _count_prompt(tok, messages) == _count_prompt(hf, messages) == want


def test_a_long_prompt_is_split_while_other_threads_run(pair):
    """A long prompt (past SavedTokenizer._LONG_TEXT) is tokenized without the GIL: another thread keeps running
    (the engine's, stepping other streams); transformers' tokenizer held it."""
    import threading
    import time

    tok, _ = pair
    text = "The quick brown fox jumps over the lazy dog, 12345 times; " * 8000
    ticks, done = [0], threading.Event()

    def spin():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.0005)

    spinner = threading.Thread(target=spin)
    spinner.start()
    start = time.perf_counter()
    ids = tok.encode(text)
    took = time.perf_counter() - start
    during = ticks[0]
    time.sleep(took)  # the reference: the spinner's own pace on this machine, for as long, with the GIL free
    idle = ticks[0] - during
    done.set()
    spinner.join()
    assert len(ids) > 100_000 and during >= 0.2 * idle, (during, idle, took)


def test_a_chat_prompt_that_writes_its_bos_gets_one_bos(tiny_models, tmp_path):
    """A llama-style tokenizer adds a BOS, and templates such as Phi-3's and Command-R's write one too: the prompt
    must start with one BOS (as the model was trained), not two. A prompt without it keeps the added one."""
    import shutil

    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    from specdecode import LLM, SamplingParams
    from specdecode.tokenizer import encode_text

    model = tmp_path / "bos_model"
    shutil.copytree(tiny_models["llama"], model)
    raw = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos = raw.token_to_id("<|endoftext|>")
    raw.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                       special_tokens=[("<|endoftext|>", bos)])
    raw.save(str(model / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(model))
    hf.chat_template = "{{ bos_token }}" + hf.chat_template
    hf.save_pretrained(str(model))
    tok = AutoTokenizer.from_pretrained(str(model))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert tok.encode(text)[:2] == [bos, bos]  # what encoding the text alone gives
    assert encode_text(tok, text) == tok.encode(text)[1:]
    assert encode_text(tok, "hi") == tok.encode("hi") and tok.encode("hi")[0] == bos != tok.encode("hi")[1]

    llm = LLM(model=str(model), speculative_config={"method": "none"}, max_model_len=128)
    params = SamplingParams(max_tokens=2, temperature=0)
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], params)
    assert chat.prompt_token_ids == tok.encode(text)[1:]
    (plain,) = llm.generate(["hi"], params)
    assert plain.prompt_token_ids == tok.encode("hi")


def test_continue_final_message_matches_transformers(pair):
    """The prompt ends inside the last message, as transformers cuts it, without transformers doing the render;
    its trailing whitespace stays (a reply that starts a code block goes on after the newline)."""
    tok, hf = pair
    for final in ("```python\n", "Sure, here", "  The answer is", "x\n\n"):
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": final}]
        ours = apply_chat_template(tok, msgs, False, continue_final_message=True)
        assert ours == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False,
                                              continue_final_message=True)
        assert ours.endswith(final) and ours.startswith(apply_chat_template(tok, msgs[:1], False))
    with pytest.raises(ValueError, match="add_generation_prompt"):
        apply_chat_template(tok, msgs, True, continue_final_message=True)
    with pytest.raises(ValueError, match="text to continue"):
        apply_chat_template(tok, msgs[:1] + [{"role": "assistant", "content": " "}], False,
                            continue_final_message=True)
