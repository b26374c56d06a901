"""Bad inputs raise ValueError with a message that says what is wrong and how to fix it; every accepted
configuration form (vLLM legacy, vLLM current, SGLang) works and gives plain greedy's output."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specdecode import LLM, Engine, SamplingParams
from specdecode.config import SpeculativeConfig, speculative_config

from helpers_spec import (GREEDY, PROMPTS, copy_model, edit_config, gen_ids, llm_cache,  # noqa: F401
                          one_thread, other_tokenizer_draft, warnings_of)


def _raises(fn, *patterns: str) -> str:
    """fn() must raise ValueError (not a torch/safetensors/KeyError traceback) whose message matches every
    regex pattern (case-insensitive)."""
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert type(info.value) is ValueError, f"{type(info.value).__name__}: {msg}"
    for p in patterns:
        assert re.search(p, msg, re.I | re.S), f"message lacks {p!r}: {msg}"
    assert "Traceback" not in msg
    return msg


# ---------------------------------------------------------------------------------------------------------
# Speculative configuration
# ---------------------------------------------------------------------------------------------------------
def test_tokenizer_mismatch(tiny_models, other_tokenizer_draft):
    # Same vocabulary size (a size-only check would pass), different tokens.
    from transformers import AutoTokenizer
    a = AutoTokenizer.from_pretrained(str(tiny_models["llama"]))
    b = AutoTokenizer.from_pretrained(str(other_tokenizer_draft))
    assert len(a) == len(b) and a.get_vocab() != b.get_vocab()
    _raises(lambda: LLM(str(tiny_models["llama"]), speculative_model=str(other_tokenizer_draft),
                        num_speculative_tokens=3, max_model_len=64),
            r"tokenizer", r"draft", r"same tokenizer|same family|\[ngram\]")


def test_a_draft_with_the_targets_tokenizer_files_is_not_loaded_twice(one_thread, tiny_models, tiny_dir,
                                                                     monkeypatch):
    """Byte-identical tokenizer files tokenize alike: the draft's tokenizer is not loaded (start-up time and
    memory); different files still go through the full comparison (test_tokenizer_mismatch)."""
    import specdecode.engine.llm_engine as le
    from specdecode.tokenizer import same_tokenizer_files

    loads = []
    real = le.load_tokenizer
    monkeypatch.setattr(le, "load_tokenizer", lambda path, gguf: loads.append(Path(path)) or real(path, gguf))
    draft = copy_model(tiny_models["llama"], tiny_dir / "llama_same_tok_draft")
    assert same_tokenizer_files(tiny_models["llama"], False, draft, False)
    LLM(str(tiny_models["llama"]), speculative_model=str(draft), num_speculative_tokens=3, max_model_len=64)
    assert loads == [Path(tiny_models["llama"])]
    changed = copy_model(tiny_models["llama"], tiny_dir / "llama_other_tok_config")
    cfg = changed / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"model_max_length": 77, ', 1))
    assert not same_tokenizer_files(tiny_models["llama"], False, changed, False)
    loads.clear()
    LLM(str(tiny_models["llama"]), speculative_model=str(changed), num_speculative_tokens=3, max_model_len=64)
    assert loads == [Path(tiny_models["llama"]), changed]


def test_draft_with_padded_embedding_rows_is_accepted(one_thread, tiny_models, tiny_dir):
    """Allowed: a draft whose embedding table has extra padding rows beyond the shared vocabulary."""
    import torch
    from safetensors.torch import load_file, save_file

    d = copy_model(tiny_models["llama"], tiny_dir / "llama_padded_vocab")
    f = d / "model.safetensors"
    t = load_file(str(f))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t[name] = torch.cat([t[name], torch.zeros(64, t[name].shape[1])]).contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    edit_config(d, vocab_size=t["lm_head.weight"].shape[0])
    llm = LLM(str(tiny_models["llama"]), speculative_model=str(d), num_speculative_tokens=3, max_model_len=64)
    plain = LLM(str(tiny_models["llama"]), max_model_len=64)
    p = dict(max_tokens=12, **GREEDY)
    assert gen_ids(llm, PROMPTS[:2], **p) == gen_ids(plain, PROMPTS[:2], **p)


def test_draft_larger_than_target_warns(one_thread, tiny_models, tiny_draft):
    msgs = warnings_of(lambda: LLM(str(tiny_draft), speculative_model=str(tiny_models["llama"]),
                                   num_speculative_tokens=2, max_model_len=64))
    # Both parameter counts are named (tiny models: 0.1M-sized numbers).
    assert any("larger" in m and len(re.findall(r"\d+(?:\.\d+)?M", m)) >= 2 for m in msgs), msgs


def test_draft_not_much_smaller_warns(one_thread, tiny_models, tiny_dir):
    """A draft the target's own size cannot pay: the warning says so and names both models."""
    same = copy_model(tiny_models["llama"], tiny_dir / "llama_same_size_draft")
    msgs = warnings_of(lambda: LLM(str(tiny_models["llama"]), speculative_model=str(same),
                                    num_speculative_tokens=2, max_model_len=64))
    assert any("not much smaller" in m and "cannot pay" in m and str(same) in m and str(tiny_models["llama"]) in m
               for m in msgs), msgs


def test_draft_differing_only_in_added_special_tokens_works_with_a_warning(one_thread, tiny_models, tiny_dir):
    """Only the added special tokens differ: the pair loads with a warning naming the tokens, and greedy output is
    plain decoding's (the target verifies every token)."""
    from transformers import AutoTokenizer

    d = copy_model(tiny_models["llama"], tiny_dir / "llama_extra_special_draft")
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.add_special_tokens({"additional_special_tokens": ["<|tool_call|>"]})
    tok.save_pretrained(str(d))
    llm = []
    msgs = warnings_of(lambda: llm.append(LLM(str(tiny_models["llama"]), speculative_model=str(d),
                                               num_speculative_tokens=3, max_model_len=64)))
    assert any("only in added special tokens" in m and "<|tool_call|>" in m for m in msgs), msgs
    plain = LLM(str(tiny_models["llama"]), max_model_len=64)
    p = dict(max_tokens=12, **GREEDY)
    assert gen_ids(llm[0], PROMPTS[:2], **p) == gen_ids(plain, PROMPTS[:2], **p)


def test_mismatched_draft_is_one_clear_line_on_the_command_line(tiny_models, other_tokenizer_draft):
    from test_cli import assert_one_line_error, run_cli

    p = run_cli("generate", "-m", tiny_models["llama"], "-md", other_tokenizer_draft, "-p", "hi", "-n", "2")
    assert_one_line_error(p, "does not share the tokenizer", str(tiny_models["llama"]), str(other_tokenizer_draft))


@pytest.mark.parametrize("k", [0, 17, -1])
def test_k_out_of_range(k, tiny_models):
    for kw in (dict(speculative_model="[ngram]", num_speculative_tokens=k),
               dict(speculative_config={"method": "ngram", "num_speculative_tokens": k})):
        msg = _raises(lambda: LLM(str(tiny_models["llama"]), **kw), r"num_speculative_tokens", r"1\s*\.\.\s*16")
        assert str(k) in msg
    # The message says why.
    msg = _raises(lambda: SpeculativeConfig(method="ngram", num_speculative_tokens=k))
    assert len(msg) > 80


def test_k_bounds_are_inclusive(tiny_models):
    for k in (1, 16):
        SpeculativeConfig(method="ngram", num_speculative_tokens=k)


def test_unknown_method_lists_valid_ones(tiny_models):
    msg = _raises(lambda: LLM(str(tiny_models["llama"]),
                              speculative_config={"method": "eagle", "num_speculative_tokens": 3}),
                  r"eagle", r"ngram", r"draft_model")
    assert "Traceback" not in msg


def test_unknown_speculative_config_key(tiny_models):
    _raises(lambda: LLM(str(tiny_models["llama"]),
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}),
            r"lookahead", r"prompt_lookup_max")


def test_missing_draft_path(tiny_models, tmp_path):
    missing = tmp_path / "no_such_draft"
    _raises(lambda: LLM(str(tiny_models["llama"]), speculative_model=str(missing), num_speculative_tokens=3),
            re.escape(missing.name), r"not found|does not exist|no such")


def test_draft_model_method_without_a_model(tiny_models):
    _raises(lambda: LLM(str(tiny_models["llama"]),
                        speculative_config={"method": "draft_model", "num_speculative_tokens": 3}),
            r"draft", r"speculative_model|model")


def test_bad_ngram_bounds(tiny_models):
    _raises(lambda: LLM(str(tiny_models["llama"]), speculative_model="[ngram]", num_speculative_tokens=3,
                        ngram_prompt_lookup_min=4, ngram_prompt_lookup_max=2),
            r"prompt_lookup_min", r"prompt_lookup_max")


# ---------------------------------------------------------------------------------------------------------
# Model paths and files
# ---------------------------------------------------------------------------------------------------------
def test_missing_model_path(tmp_path):
    missing = tmp_path / "no_such_model"
    _raises(lambda: LLM(str(missing)), re.escape(missing.name), r"not found|does not exist|no such",
            r"config\.json|\.gguf|local path")


def test_directory_without_model(tmp_path):
    (tmp_path / "empty").mkdir()
    _raises(lambda: LLM(str(tmp_path / "empty")), r"config\.json|\.gguf")


def test_corrupt_safetensors(tiny_models, tiny_dir):
    d = copy_model(tiny_models["llama"], tiny_dir / "llama_truncated")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    _raises(lambda: LLM(str(d), max_model_len=64), r"safetensors", r"corrupt|truncat|invalid|unreadable",
            r"re-?download|re-?save")


def test_garbage_safetensors_header(tiny_models, tiny_dir):
    d = copy_model(tiny_models["llama"], tiny_dir / "llama_garbage")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    _raises(lambda: LLM(str(d), max_model_len=64), r"safetensors", r"corrupt|invalid|unreadable")


def test_unsupported_architecture(tiny_models, tiny_dir):
    d = copy_model(tiny_models["llama"], tiny_dir / "llama_unsupported")
    edit_config(d, architectures=["MambaForCausalLM"], model_type="mamba")
    _raises(lambda: LLM(str(d), max_model_len=64), r"MambaForCausalLM", r"unsupported|not supported",
            r"LlamaForCausalLM", r"Qwen2ForCausalLM", r"GPT2LMHeadModel")


def test_broken_config_json(tiny_models, tiny_dir):
    d = copy_model(tiny_models["llama"], tiny_dir / "llama_badjson")
    (d / "config.json").write_text("{not json")
    _raises(lambda: LLM(str(d), max_model_len=64), r"config\.json", r"json")


# ---------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len(one_thread, llm_cache, tiny_models):
    llm = llm_cache.get(tiny_models["llama"], max_model_len=32)
    for prompt in ([7] * 40, [7] * 32):
        _raises(lambda: llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=4),
                                     use_tqdm=False),
                str(len(prompt)), r"max_model_len", r"shorten|raise|increase")
    # Text prompts too, and one bad prompt in a batch fails before any work is queued.
    _raises(lambda: llm.generate(["hi", "fox " * 100], SamplingParams(max_tokens=4), use_tqdm=False),
            r"max_model_len")
    assert not llm.engine.has_unfinished_requests()
    out = gen_ids(llm, [[7] * 31], max_tokens=4, **GREEDY)[0]  # fits: room for exactly one token
    assert len(out) == 1


@pytest.mark.parametrize("kw,patterns", [
    (dict(temperature=-0.1), [r"temperature", r">= ?0"]),
    (dict(top_p=0.0), [r"top_p", r"\(0, 1\]"]),
    (dict(top_p=1.5), [r"top_p", r"\(0, 1\]"]),
    (dict(max_tokens=0), [r"max_tokens", r">= ?1"]),
    (dict(max_tokens=-3), [r"max_tokens", r">= ?1"]),
    (dict(top_k=-5), [r"top_k"]),
    (dict(min_p=1.5), [r"min_p"]),
    (dict(n=0), [r"\bn\b"]),
])
def test_invalid_sampling_params(kw, patterns):
    msg = _raises(lambda: SamplingParams(**kw), *patterns)
    assert str(list(kw.values())[0]) in msg  # it names the offending value


def test_valid_sampling_params_edges():
    SamplingParams(temperature=0.0, top_p=1.0, max_tokens=1)
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=1, min_p=1.0)


# ---------------------------------------------------------------------------------------------------------
# Accepted configuration forms: all give plain greedy's output
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_text(one_thread, llm_cache, tiny_models):
    llm = llm_cache.get(tiny_models["llama"])
    return {tuple(p): gen_ids(llm, [p], max_tokens=16, **GREEDY)[0] for p in PROMPTS}


def test_vllm_current_form_ngram(plain_text, llm_cache, tiny_models):
    llm = llm_cache.get(tiny_models["llama"],
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    spec = llm.config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.model) == ("ngram", 3, 3, None)
    assert gen_ids(llm, PROMPTS, max_tokens=16, **GREEDY) == [plain_text[tuple(p)] for p in PROMPTS]
    assert llm.spec_decode_metrics.num_draft_tokens > 0


def test_vllm_current_form_method_inferred_from_model(plain_text, llm_cache, tiny_models, tiny_draft):
    llm = llm_cache.get(tiny_models["llama"],
                        speculative_config={"model": str(tiny_draft), "num_speculative_tokens": 3})
    spec = llm.config.speculative
    assert (spec.method, spec.num_speculative_tokens) == ("draft_model", 3)
    assert gen_ids(llm, PROMPTS, max_tokens=16, **GREEDY) == [plain_text[tuple(p)] for p in PROMPTS]
    assert llm.spec_decode_metrics.num_draft_tokens > 0
    # "[ngram]" as the model means n-gram lookup.
    cfg = speculative_config({"model": "[ngram]", "num_speculative_tokens": 2})
    assert (cfg.method, cfg.model) == ("ngram", None)


def test_vllm_legacy_keywords(plain_text, llm_cache, tiny_models, tiny_draft):
    llm = llm_cache.get(tiny_models["llama"], speculative_model="[ngram]", num_speculative_tokens=2,
                        ngram_prompt_lookup_max=3, ngram_prompt_lookup_min=2)
    spec = llm.config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == \
        ("ngram", 2, 3, 2)
    assert gen_ids(llm, PROMPTS, max_tokens=16, **GREEDY) == [plain_text[tuple(p)] for p in PROMPTS]
    _raises(lambda: LLM(str(tiny_models["llama"]), speculative_model="[ngram]", num_speculative_tokens=2,
                        speculative_config={"method": "ngram"}), r"speculative_config", r"not both|either")


def test_speculative_disable_by_batch_size(plain_text, llm_cache, tiny_models, tiny_draft):
    llm = llm_cache.get(tiny_models["llama"], speculative_model=str(tiny_draft), num_speculative_tokens=3,
                        speculative_disable_by_batch_size=2)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=16, **GREEDY),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [plain_text[tuple(p)] for p in PROMPTS]
    assert all(o.metrics.spec_decode.num_drafts == 0 for o in outs)  # 4 running >= 2: no speculation
    one = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(max_tokens=16, **GREEDY),
                       use_tqdm=False)[0]
    assert one.metrics.spec_decode.num_drafts > 0 and list(one.outputs[0].token_ids) == plain_text[tuple(PROMPTS[0])]


def test_sglang_engine(one_thread, llm_cache, tiny_models, tiny_draft):
    prompts = ["The quick brown fox", "def add(a, b):\n", "Once upon a time"]
    want = [o.outputs[0].text for o in llm_cache.get(tiny_models["llama"]).generate(
        prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)]
    # SGLang's speculative_num_draft_tokens counts the verified token: 4 means k = 3 drafted tokens.
    eng = Engine(model_path=str(tiny_models["llama"]), speculative_draft_model_path=str(tiny_draft),
                 speculative_num_draft_tokens=4)
    assert eng.llm.config.speculative.method == "draft_model"
    assert eng.llm.config.speculative.num_speculative_tokens == 3
    outs = eng.generate(prompts, {"temperature": 0, "max_new_tokens": 10})
    assert isinstance(outs, list) and all(isinstance(o, dict) for o in outs)
    assert [o["text"] for o in outs] == want
    single = eng.generate(prompts[0], {"temperature": 0, "max_new_tokens": 10})
    assert isinstance(single, dict) and single["text"] == want[0]
    eng.shutdown()


def test_quantization_values_and_device(tiny_models):
    from specdecode.config import EngineConfig

    model = str(tiny_models["llama"])
    _raises(lambda: EngineConfig(model=model, quantization="int4"), "int8", "w8a8", "int4")
    # The quantized formats are CPU kernels: asking for them elsewhere is an error, not a silent fp run.
    _raises(lambda: EngineConfig(model=model, quantization="w8a8", device="xpu"), "w8a8", "xpu", "CPU",
            "bfloat16")
    assert EngineConfig(model=model, quantization="w8a8", device="cpu").quantization == "w8a8"
    assert EngineConfig(model=model, quantization="w4a8", device="cpu").quantization == "w4a8"


def test_draft_quantization_validation(tiny_models, tiny_draft):
    from specdecode.config import EngineConfig

    model, draft = str(tiny_models["llama"]), str(tiny_draft)
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_model="[ngram]", num_speculative_tokens=2,
                                             speculative_model_quantization="w4a8"), "quantization", "draft model")
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_model=draft, num_speculative_tokens=2,
                                             speculative_model_quantization="int3"), "w4a8", "int3")
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_model=draft, num_speculative_tokens=2,
                                             speculative_model_quantization="w4a8", device="xpu"), "w4a8", "xpu")
    # vLLM's current form takes the same key inside speculative_config.
    cfg = EngineConfig.from_kwargs(model=model, speculative_config={"model": draft, "num_speculative_tokens": 2,
                                                                    "quantization": "w4a8"})
    assert cfg.speculative.quantization == "w4a8" and cfg.quantization is None
    cfg = EngineConfig.from_kwargs(model=model, quantization="w8a8", speculative_model=draft,
                                   num_speculative_tokens=2, speculative_model_quantization="none")
    assert cfg.draft_quantization() is None and cfg.quantization == "w8a8"
    cfg = EngineConfig.from_kwargs(model=model, quantization="w8a8", speculative_model=draft, num_speculative_tokens=2)
    assert cfg.draft_quantization() == "w8a8"


def test_draft_vocab_size_validation(tiny_models, tiny_draft):
    model = str(tiny_models["llama"])
    _raises(lambda: LLM(model, speculative_model="[ngram]", num_speculative_tokens=2,
                        speculative_draft_vocab_size=1024), "draft_vocab_size", "draft model")
    _raises(lambda: LLM(model, speculative_model=str(tiny_draft), num_speculative_tokens=2,
                        speculative_draft_vocab_size=10), "draft_vocab_size", "256")
    _raises(lambda: LLM(model, speculative_model="[ngram]", num_speculative_tokens=2,
                        speculative_token_map=__file__), "token_map", "draft model")
    _raises(lambda: LLM(model, speculative_model=str(tiny_draft), num_speculative_tokens=2,
                        speculative_token_map="/nonexistent/map.json"), "token_map", "existing file")


def test_draft_confidence_validation(tiny_models, tiny_draft):
    from specdecode.config import EngineConfig

    model, draft = str(tiny_models["llama"]), str(tiny_draft)
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_model=draft, num_speculative_tokens=2,
                                             speculative_draft_confidence=1.0), "draft_confidence", r"\[0, 1\)")
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_model="[ngram]", num_speculative_tokens=2,
                                             speculative_draft_confidence=0.3), "draft_confidence", "n-gram")
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_config={
        "model": draft, "num_speculative_tokens": 2, "draft_confidence": "high"}), "draft_confidence", "'high'")
    conf = lambda **kw: EngineConfig.from_kwargs(model=model, speculative_model=draft,  # noqa: E731
                                                 num_speculative_tokens=2, **kw).speculative.draft_confidence
    assert (conf(), conf(speculative_adaptive=True), conf(speculative_draft_confidence=0.6)) == (0.0, 0.0, 0.6)


def test_ngram_first_validation_and_defaults(tiny_models, tiny_draft):
    from specdecode.config import EngineConfig

    model, draft = str(tiny_models["llama"]), str(tiny_draft)
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_model="[ngram]", num_speculative_tokens=2,
                                             speculative_ngram_first=True), "ngram_first", "draft model")
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_model=draft, num_speculative_tokens=2,
                                             speculative_ngram_first=True, ngram_prompt_lookup_min=5,
                                             ngram_prompt_lookup_max=4), "prompt_lookup_min", "5")
    # Lookup ahead of a draft model needs a 3-token match by default; plain n-gram drafting takes any match.
    cfg = EngineConfig.from_kwargs(model=model, speculative_config={"model": draft, "num_speculative_tokens": 2,
                                                                    "ngram_first": True})
    assert (cfg.speculative.prompt_lookup_min, cfg.speculative.prompt_lookup_max) == (3, 4)
    cfg = EngineConfig.from_kwargs(model=model, speculative_model="[ngram]", num_speculative_tokens=2)
    assert cfg.speculative.prompt_lookup_min == 1


def test_prompt_lookup_num_tokens(tiny_models, tiny_draft):
    """The lookup's own cap (ngram_first only): validated, defaulting to k, and the widest k calibrated."""
    from specdecode.config import EngineConfig

    model, draft = str(tiny_models["llama"]), str(tiny_draft)
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_model="[ngram]", num_speculative_tokens=2,
                                             prompt_lookup_num_tokens=8), "prompt_lookup_num_tokens", "ngram_first")
    _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_model=draft, num_speculative_tokens=2,
                                             prompt_lookup_num_tokens=8), "prompt_lookup_num_tokens", "ngram_first")
    for bad in (0, 17, 2.5, True):
        _raises(lambda: EngineConfig.from_kwargs(model=model, speculative_config={
            "model": draft, "num_speculative_tokens": 2, "ngram_first": True, "prompt_lookup_num_tokens": bad}),
            "prompt_lookup_num_tokens", "1..16")
    spec = EngineConfig.from_kwargs(model=model, speculative_model=draft, num_speculative_tokens=3,
                                    speculative_ngram_first=True).speculative
    assert (spec.lookup_k, spec.max_k) == (3, 3)
    spec = EngineConfig.from_kwargs(model=model, speculative_model=draft, num_speculative_tokens=3,
                                    speculative_ngram_first=True, prompt_lookup_num_tokens=10).speculative
    assert (spec.lookup_k, spec.max_k) == (10, 10)
    spec = EngineConfig.from_kwargs(model=model, speculative_config={
        "model": draft, "num_speculative_tokens": 6, "ngram_first": True, "prompt_lookup_num_tokens": 2}).speculative
    assert (spec.lookup_k, spec.max_k) == (2, 6)


def test_max_model_len_beyond_the_models_context_is_refused_in_python_too(tiny_models, monkeypatch, tmp_path):
    """LLM(max_model_len=...) beyond the model's own context (1024 for the tiny llama) is a ValueError naming
    both numbers, as in vLLM; SPECDECODE_ALLOW_LONG_MAX_MODEL_LEN=1 stretches a RoPE model on purpose."""
    from specdecode import LLM

    with pytest.raises(ValueError, match=r"max_model_len=2048 .* maximum context of 1024"):
        LLM(str(tiny_models["llama"]), max_model_len=2048, speculative_config={"method": "none"})
    monkeypatch.setenv("SPECDECODE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(str(tiny_models["llama"]), max_model_len=2048, speculative_config={"method": "none"})
    assert llm.engine.max_model_len == 2048
    monkeypatch.delenv("SPECDECODE_ALLOW_LONG_MAX_MODEL_LEN")
    # A draft model shorter than the target's max_model_len still drafts (its guesses only cost speed).
    short = copy_model(tiny_models["llama"], tmp_path / "short_draft")
    edit_config(short, max_position_embeddings=256)
    llm = LLM(str(tiny_models["llama"]), max_model_len=512, speculative_model=str(short), num_speculative_tokens=2)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(max_tokens=8, **GREEDY),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
