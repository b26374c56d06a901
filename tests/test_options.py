"""The option table: one set of names on every surface, aliases, unknown options, the preset as the defaults,
speculation off as one switch, and generate's chat template."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specdecode import presets
from specdecode.config import EngineConfig, speculation_off
from specdecode.entrypoints.cli import build_parser, main
from specdecode.options import OPTIONS, kwargs_from_args, markdown_table

from helpers_spec import warnings_of

ROOT = Path(__file__).resolve().parent.parent
P = presets.DEFAULT


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    import torch
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _subparsers() -> dict:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


def _flags(sub) -> dict[str, tuple[str, ...]]:
    """dest -> option strings, for the table's options (dest 'engine.x' / 'speculative.x')."""
    out: dict[str, set] = {}
    for a in sub._actions:
        if a.dest.startswith(("engine.", "speculative.")):
            out.setdefault(a.dest, set()).update(a.option_strings)
    return {d: tuple(sorted(s)) for d, s in out.items()}


def _parse(command: str, *argv: str):
    return build_parser().parse_args([command, *argv])


def _config(command: str, *argv: str) -> EngineConfig:
    """The EngineConfig a subcommand would build from these flags (nothing is loaded)."""
    args = _parse(command, *argv)
    if command == "serve":
        from specdecode.entrypoints.openai.cli_args import engine_kwargs_from_args
        return EngineConfig.from_kwargs(**engine_kwargs_from_args(args, args.model_tag))
    from specdecode.entrypoints.cli._shared import engine_kwargs
    return EngineConfig.from_kwargs(**engine_kwargs(args, max_num_seqs=1))


# ---------------------------------------------------------------- one set of names
def test_serve_takes_every_option_generate_takes_under_the_same_names(capsys):
    subs = _subparsers()
    gen, chat, serve = (_flags(subs[c]) for c in ("generate", "chat", "serve"))
    spec = {d: f for d, f in gen.items() if d.startswith("speculative.")}
    assert {"speculative.adaptive", "speculative.ngram_first", "speculative.draft_p_min",
            "speculative.method", "speculative.num_speculative_tokens"} <= set(spec)
    for dest, flags in gen.items():
        if dest == "engine.model":  # serve also takes the model as its positional argument
            assert set(flags) <= set(serve[dest])
            continue
        assert serve.get(dest) == flags, dest
        assert chat.get(dest) == flags, dest
    # and --help says so: every long flag of generate's speculative options is in serve's help text
    assert main(["serve", "--help"]) == 0
    serve_help = capsys.readouterr().out
    assert main(["generate", "--help"]) == 0
    gen_help = capsys.readouterr().out
    for flags in spec.values():
        for f in flags:
            assert f in gen_help and f in serve_help, f
    for text in (gen_help, serve_help):  # the opt-outs are named
        for f in ("-q none", "--spec-type none", "--no-adaptive", "--draft-vocab-size 0"):
            assert f in text, f


def test_bench_uses_the_same_names():
    gen, bench = _flags(_subparsers()["generate"]), _flags(_subparsers()["bench"])
    for dest, flags in bench.items():
        assert set(gen[dest]) <= set(flags), dest  # bench may add --k; never renames


def test_options_reference_is_generated_from_the_table(capsys):
    assert main(["options"]) == 0
    out = capsys.readouterr().out
    assert out == markdown_table()
    assert (ROOT / "docs" / "options.md").read_text() == out, "regenerate: specdecode options > docs/options.md"
    for o in OPTIONS:
        assert f"`{o.name}`" in out and all(f"`{f}`" in out for f in o.flags)


# ---------------------------------------------------------------- unknown and ignored options
def test_unknown_option_names_close_matches():
    with pytest.raises(ValueError, match=r"Unknown option 'max_model_lenn' \(did you mean 'max_model_len'\?\)"):
        EngineConfig.from_kwargs(max_model_lenn=128)
    with pytest.raises(ValueError, match=r"did you mean 'num_speculative_tokens'"):
        EngineConfig.from_kwargs(num_speculative_token=3)
    with pytest.raises(ValueError, match=r"'draft_p_mn'.*did you mean 'draft_p_min'"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "draft_p_mn": 0.1})
    with pytest.raises(ValueError, match=r"tokenizer.*not supported"):
        EngineConfig.from_kwargs(tokenizer="/some/path")


def test_unknown_flag_names_close_matches(capsys):
    assert main(["generate", "--draft-p-mn", "0.3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft-p-mn" in err[0] and "--draft-p-min" in err[0], err


def test_vllm_options_that_do_not_apply_warn():
    got = []
    warned = " ".join(warnings_of(lambda: got.append(EngineConfig.from_kwargs(
        model=None, tensor_parallel_size=1, gpu_memory_utilization=0.9, enforce_eager=True, trust_remote_code=True))))
    cfg = got[0]
    for name in ("tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "trust_remote_code"):
        assert name in warned
    assert cfg.max_num_seqs == 8
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineConfig.from_kwargs(tensor_parallel_size=2)


# ---------------------------------------------------------------- aliases
def test_sglang_and_vllm_aliases(tiny_models, tiny_draft):
    model, draft = str(tiny_models["llama"]), str(tiny_draft)
    # SGLang: speculative_num_draft_tokens counts the verified token, so k = value - 1.
    c = EngineConfig.from_kwargs(model_path=model, speculative_draft_model_path=draft, speculative_num_draft_tokens=5,
                                 context_length=128, random_seed=3, max_running_requests=2, threads=1)
    assert (c.model, c.speculative.model, c.speculative.num_speculative_tokens) == (model, draft, 4)
    assert (c.max_model_len, c.seed, c.max_num_seqs, c.num_threads) == (128, 3, 2, 1)
    assert EngineConfig.from_kwargs(model=model, speculative_draft_model_path=draft,
                                    speculative_num_steps=3).speculative.num_speculative_tokens == 3
    c = EngineConfig.from_kwargs(model=model, speculative_algorithm="NGRAM", num_speculative_tokens=3)
    assert (c.speculative.method, c.speculative.num_speculative_tokens) == ("ngram", 3)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens.*verified token"):
        EngineConfig.from_kwargs(model=model, speculative_draft_model_path=draft, speculative_num_draft_tokens=1)
    # two spellings of one option must agree
    with pytest.raises(ValueError, match="same option"):
        EngineConfig.from_kwargs(model=model, speculative_model=draft, num_speculative_tokens=3,
                                 speculative_num_steps=2)
    # speculative_config keys: vLLM's legacy names inside the dict
    c = EngineConfig.from_kwargs(model=model, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                  "ngram_prompt_lookup_max": 3})
    assert c.speculative.prompt_lookup_max == 3
    with pytest.raises(ValueError, match="eagle.*not implemented"):
        EngineConfig.from_kwargs(model=model, speculative_config={"method": "eagle", "model": draft})


def test_llama_cpp_flag_aliases(tiny_models, tiny_draft):
    args = _parse("generate", "-m", str(tiny_models["llama"]), "-md", str(tiny_draft), "--spec-draft-n-max", "6",
                  "--spec-draft-p-min", "0.5", "-c", "128", "-np", "2", "-t", "1", "--draft-vocab-size", "none",
                  "-qd", "w4a8", "--spec-draft-n-min", "0")
    kw = kwargs_from_args(args)
    assert kw == {"model": str(tiny_models["llama"]), "speculative_model": str(tiny_draft),
                  "num_speculative_tokens": 6, "speculative_draft_p_min": 0.5, "max_model_len": 128,
                  "max_num_seqs": 2, "num_threads": 1, "speculative_draft_vocab_size": 0,
                  "speculative_model_quantization": "w4a8"}
    c = EngineConfig.from_kwargs(**kw)
    assert (c.speculative.num_speculative_tokens, c.speculative.draft_p_min, c.speculative.draft_vocab_size,
            c.speculative.quantization) == (6, 0.5, None, "w4a8")
    spec = _config("generate", "-m", str(tiny_models["llama"]), "--spec-type", "ngram-simple", "--draft-max", "5").speculative
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 5)
    assert _config("serve", "--speculative-num-draft-tokens", "5", "--spec-type", "ngram").speculative.num_speculative_tokens == 4


def test_draft_min_is_rejected_by_name(capsys):
    # llama.cpp's --draft-min has no equivalent here: only "no minimum" passes, anything else is an error
    assert main(["generate", "--spec-draft-n-min", "3", "-p", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--spec-draft-n-min" in err[0] and "not implemented" in err[0], err


# ---------------------------------------------------------------- speculation off is one switch
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_spec_type_none_is_plain_decoding_everywhere(command, tiny_models):
    assert _config(command, "--spec-type", "none").speculative is None
    assert _config(command, "-m" if command != "serve" else "--model", str(tiny_models["llama"]),
                   "--spec-type", "none").speculative is None
    assert EngineConfig.from_kwargs(speculative_config={"method": "none"}).speculative is None
    assert EngineConfig.from_kwargs(speculative_model="none").speculative is None
    # the engine's own switch reads a speculative_config dict as LLM() does
    assert all(speculation_off(d) for d in ({"method": "none"}, {"method": "NONE"}, {"model": "off"}))
    assert not any(speculation_off(d) for d in ({"method": "ngram"}, {"model": "[ngram]"}, {}))
    with pytest.raises(ValueError, match="disagree"):  # as LLM(speculative_config=...) rejects it
        speculation_off({"method": "ngram", "model": "none"})


def test_spec_type_none_decodes_plainly(tiny_models, capsys):
    assert main(["generate", "-m", str(tiny_models["llama"]), "--spec-type", "none", "-p", "The quick brown fox",
                 "-n", "8", "--json", "-t", "1", "--ignore-eos"]) == 0
    s = json.loads(capsys.readouterr().out)["stats"]
    assert (s["n_draft"], s["n_drafts"], s["n_drafted"], s["draft"]) == (0, 0, 0, "none")


def test_one_resolver_for_every_speculative_config(tiny_models, tiny_draft):
    """A speculative_config dict resolves to the same SpeculativeConfig through every entry point: LLM(...),
    LLMEngine.set_speculative, and the --speculative-config flag of serve and generate (the preset unless k is
    given)."""
    from specdecode import LLM
    from specdecode.engine.llm_engine import LLMEngine

    model, draft = str(tiny_models["llama"]), str(tiny_draft)
    engine = LLMEngine.from_kwargs(model=model, speculative_model=draft, num_threads=1)
    dicts = ({"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 4}, {"method": "none"},
             {"method": "draft_model", "model": draft}, {"model": draft, "num_speculative_tokens": 3})
    for d in dicts:
        flag = ("--speculative-config", json.dumps(d))
        engine.set_speculative(d)
        resolved = [LLM(model, speculative_config=d, num_threads=1).config.speculative, engine.config.speculative,
                    _config("serve", model, *flag).speculative, _config("generate", "-m", model, *flag).speculative]
        assert all(r == resolved[0] for r in resolved), (d, resolved)
    assert resolved[0].num_speculative_tokens == 3 and not resolved[0].adaptive
    engine.set_speculative({"method": "ngram"})
    spec = engine.config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive) == ("ngram", P.lookup_tokens, True)


# ---------------------------------------------------------------- defaults = the preset
def test_defaults_resolve_to_the_preset():
    import torch

    for cfg in (EngineConfig.from_kwargs(), _config("generate"), _config("chat"), _config("serve")):
        spec = cfg.speculative
        assert (spec.method, spec.model) == ("draft_model", "default")
        assert (spec.num_speculative_tokens, spec.adaptive, spec.ngram_first, spec.prompt_lookup_num_tokens) == \
            (P.num_speculative_tokens, True, True, P.lookup_tokens)
        assert spec.draft_vocab_size == "auto" and spec.head_size(True) == P.draft_vocab_size
        assert spec.head_size(False) is None  # no ranking known for the tokenizer: the full head
        if torch.cuda.is_available():
            assert (cfg.dtype, cfg.quantization, cfg.draft_quantization()) == (P.cuda_dtype, None, None)
        else:
            assert (cfg.quantization, cfg.draft_quantization()) == (P.target_quantization, P.draft_quantization)
    assert _config("generate").max_num_seqs == 1 and _config("serve").max_num_seqs == 8


def test_each_part_of_the_preset_is_an_opt_out(tiny_draft):
    full = _config("generate", "-q", "none")
    assert (full.quantization, full.draft_quantization()) == (None, None) and full.speculative.adaptive
    spec = _config("serve", "--no-adaptive").speculative
    assert (spec.adaptive, spec.ngram_first, spec.num_speculative_tokens) == (False, True, P.num_speculative_tokens)
    assert _config("generate", "--no-ngram-first").speculative.prompt_lookup_num_tokens is None
    assert _config("chat", "--draft-vocab-size", "0").speculative.draft_vocab_size is None
    # giving k fixes it: the named method at that k, as in vLLM and llama-speculative
    spec = _config("generate", "--draft", "6").speculative
    assert (spec.num_speculative_tokens, spec.adaptive, spec.ngram_first) == (6, False, False)
    spec = _config("generate", "--draft", "6", "--adaptive", "--ngram-first").speculative
    assert (spec.num_speculative_tokens, spec.adaptive, spec.ngram_first, spec.lookup_k) == (6, True, True, 6)
    assert _config("generate", "--dtype", "float32").quantization is None  # an explicit float dtype: unquantized
    # a user's draft with the built-in target keeps the policy
    spec = EngineConfig.from_kwargs(speculative_model=str(tiny_draft)).speculative
    assert (spec.model, spec.adaptive, spec.ngram_first, spec.num_speculative_tokens) == \
        (str(tiny_draft), True, True, P.num_speculative_tokens)


def test_a_users_target_gets_the_policy_with_its_draft(tiny_models, tiny_draft):
    model, draft = str(tiny_models["llama"]), str(tiny_draft)
    plain = EngineConfig.from_kwargs(model=model)
    assert plain.speculative is None  # no draft given: plain decoding, as in vLLM and llama.cpp
    assert plain.quantization is None  # a test-sized checkpoint: nothing to gain from integer weights
    spec = EngineConfig.from_kwargs(model=model, speculative_model=draft).speculative
    assert (spec.adaptive, spec.ngram_first, spec.prompt_lookup_num_tokens) == (True, True, P.lookup_tokens)
    spec = EngineConfig.from_kwargs(model=model, speculative_model="[ngram]").speculative
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive) == ("ngram", P.lookup_tokens, True)
    with pytest.raises(ValueError, match="without a draft"):
        EngineConfig.from_kwargs(model=model, num_speculative_tokens=3)


def test_default_llm_end_to_end():
    """The default LLM() (the fast preset on the built-in pair) gives plain greedy decoding's tokens: the same
    loaded engine with speculation switched off is the reference (plain w8a8 decoding of the same target)."""
    from specdecode import LLM, SamplingParams

    llm = LLM(max_model_len=256)
    spec = llm.config.speculative
    assert spec.adaptive and spec.ngram_first and llm.config.quantization == P.target_quantization
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}],
                                                     tokenize=False, add_generation_prompt=True)
    fast = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.engine.set_speculative({"method": "none"})  # vLLM's off switch, as in LLM(speculative_config=...)
    assert llm.engine.proposer is None and llm.engine.config.speculative is None
    plain = llm.generate([prompt], params, use_tqdm=False)[0]
    assert plain.metrics.spec_decode.num_drafts == 0
    assert list(plain.outputs[0].token_ids) == list(fast.outputs[0].token_ids)


# ---------------------------------------------------------------- chat template by default
def test_generate_applies_the_chat_template_unless_raw(tiny_models, capsys):
    from specdecode.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(Path(tiny_models["llama"]), False)
    base = ["generate", "-m", str(tiny_models["llama"]), "-p", "Once upon a time", "-n", "4", "--json", "-t", "1",
            "--spec-type", "none"]
    assert main(base) == 0
    chat = json.loads(capsys.readouterr().out)
    templated = apply_chat_template(tok, [{"role": "user", "content": "Once upon a time"}])
    assert chat["chat_template"] and chat["prompt_token_ids"] == tok.encode(templated)
    assert re.search(r"<\|user\|>Once upon a time<\|end\|><\|assistant\|>", templated)
    for flag in ("--raw", "-no-cnv"):
        assert main(base + [flag]) == 0
        raw = json.loads(capsys.readouterr().out)
        assert not raw["chat_template"] and raw["prompt_token_ids"] == tok.encode("Once upon a time")


def test_sglang_engine_defaults_to_128_new_tokens(tiny_models):
    from specdecode import Engine

    eng = Engine(model_path=str(tiny_models["llama"]), context_length=256)
    out = eng.generate("The quick brown fox", {"temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 128


# ---------------------------------------------------------------- the Ray hook
def test_serve_ray_flags(monkeypatch, capsys, tiny_models):
    assert main(["serve", "--num-replicas", "2"]) == 2
    assert "--ray" in capsys.readouterr().err
    import specdecode.entrypoints.ray.serve as ray_serving

    seen = {}
    monkeypatch.setattr(ray_serving, "serve_from_args",
                        lambda args, kw: seen.update(replicas=args.num_replicas, kw=kw) or 0)
    assert main(["serve", str(tiny_models["llama"]), "--ray", "--num-replicas", "2", "--no-adaptive"]) == 0
    assert seen["replicas"] == 2
    assert seen["kw"] == {"model": str(tiny_models["llama"]), "speculative_adaptive": False}
