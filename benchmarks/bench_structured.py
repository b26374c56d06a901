"""JSON-constrained decoding with and without speculation, in one process, on Spec-Bench extraction prompts.

    python benchmarks/bench_structured.py [--prompts 4] [--max-tokens 128] [--rounds 2] [--threads N] [--compact]
                                          [--schema extraction|generic]

Each prompt asks for a JSON object of a fixed schema and is decoded under that schema by the default engine.
``--schema extraction`` (the default) gives each question the schema of what it asks to extract (books with
their author and year, ratings per review, entities by type, ...): the values come from the prompt. ``generic``
gives every question one nested schema (a free-text summary first, then name/value items and a confidence
enum); within 128 tokens most answers are the summary, so that is free text under a grammar. Interleaved per
round:
- ``one token per pass``: speculation off and no jump-forward either: every output token costs one target
  pass, as in an engine without speculation (the bench switches the forced drafts off; the engine has no such
  option, since they are free);
- ``constrained plain``: speculation off (``set_speculative(None)``). Tokens the grammar forces are still
  drafted and verified (jump-forward), as they are whenever a grammar is active;
- ``constrained default``: the default speculative policy.
Reports each config's best round in decode tokens/s (tokens after the first over the time from the first token
to the last, summed over the prompts: prefill excluded, as serve_compare's decode tok/s) and in tokens/s over
wall time (prefill included, which the three configs share), the ratios,
whether both greedy outputs are the same token for token and (where they ended before max_tokens) parse as
JSON, and the grammar's own time per output token (the matcher's calls in the engine step, timed around
them) against the time of a plain decode step (first token to last, per token after the first).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode import LLM, SamplingParams
from specdecode.speculative.metrics import SpecDecodeStats
from specdecode.structured import StructuredOutputsParams
from specdecode.tokenizer import apply_chat_template

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench" / "spec_bench_questions.jsonl"
SCHEMA = {"type": "object", "properties": {
    "summary": {"type": "string"},
    "items": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                        "value": {"type": "string"}},
                                         "required": ["name", "value"]}},
    "confidence": {"enum": ["high", "medium", "low"]}}, "required": ["summary", "items", "confidence"]}
ASK = "\nAnswer as a JSON object with a summary, the extracted items (name, value) and your confidence."


def _array(items: dict) -> dict:
    return {"type": "array", "items": items}


def _obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


_STR, _INT, _NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}
# Spec-Bench's extraction questions in file order, each with the schema of the answer it asks for.
EXTRACTION = [
    _obj(ratings=_array(_obj(review=_INT, rating={"type": "integer", "minimum": 1, "maximum": 5}))),
    _obj(answers=_array(_obj(question=_INT, category={"enum": ["Literature", "History", "Science", "Art"]}))),
    _obj(books=_array(_obj(main_character=_STR, book=_STR, author=_STR, year_of_publication=_INT))),
    _obj(company=_STR, ceo=_STR, profit_usd_billion=_NUM),
    _obj(entries=_array(_obj(country=_STR, capital=_STR, language=_STR))),
    _obj(counts=_array(_obj(word={"enum": ["Amazon", "river", "you"]}, appearances=_INT))),
    _obj(people=_array(_STR), organizations=_array(_STR), locations=_array(_STR)),
    _obj(ratings=_array(_obj(phone={"enum": ["iPhone", "Samsung Galaxy", "Google Pixel"]}, rating=_NUM))),
    _obj(equations=_array(_obj(equation=_INT, variables=_array(_STR)))),
    _obj(months=_array(_obj(month=_STR, highest_close=_NUM, lowest_close=_NUM))),
]


class GrammarClock:
    """Time spent in the grammar's calls during engine steps (proposal checks, row masks, token commits)."""

    def __init__(self) -> None:
        import specdecode.engine.llm_engine as engine_module

        self.seconds = 0.0
        # The engine's own references: calls the grammar helpers make to each other are not counted twice.
        for name in ("forced_drafts", "constrain_proposal", "mask_rows", "commit_token"):
            setattr(engine_module, name, self._timed(getattr(engine_module, name)))

    def _timed(self, fn):
        if getattr(fn, "_grammar_clock", False):
            return fn

        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        run._grammar_clock = True
        return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=str(SPEC_BENCH))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--schema", choices=["extraction", "generic"], default="extraction")
    ap.add_argument("--compact", action="store_true",
                    help="compact JSON (disable_any_whitespace): the grammar forces every structural token")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.dataset)]
    questions = [r["turns"][0] for r in rows if r.get("category") == "extraction"][:args.prompts]
    if args.schema == "extraction":
        schemas = EXTRACTION[:len(questions)]
        asks = ["\nAnswer as a JSON object."] * len(questions)
    else:
        schemas, asks = [SCHEMA] * len(questions), [ASK] * len(questions)
    clock = GrammarClock()
    llm = LLM(max_num_seqs=1, **({"num_threads": args.threads} if args.threads else {}))
    engine, tok = llm.engine, llm.get_tokenizer()
    default = engine.config.speculative
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q + a}], True) for q, a in zip(questions, asks)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=args.compact)) for schema in schemas]
    configs = {"one token per pass": None, "constrained plain": None, "constrained default": default}
    import specdecode.engine.llm_engine as engine_module
    jump_forward = engine_module.constrain_proposal, engine_module.forced_drafts

    def no_jump_forward(reqs, prop, forced, budgets, proposer=None, text_lookup=None):
        return prop if proposer is None else jump_forward[0](reqs, prop, forced, budgets, proposer, text_lookup)

    def nothing_forced(reqs, budgets):
        return [[] for _ in reqs]
    rates: dict[str, list[float]] = {k: [] for k in configs}
    grammar: dict[str, list[float]] = {k: [] for k in configs}
    step: dict[str, list[float]] = {k: [] for k in configs}  # decode seconds per token after the first
    outputs: dict[str, list[list[int]]] = {}
    stopped: list[bool] = []  # per prompt: ended by the grammar / EOS, not by max_tokens
    for _ in range(args.rounds):
        for name, spec in configs.items():
            engine.set_speculative(spec)
            engine.reset_prefix_cache()
            engine_module.constrain_proposal, engine_module.forced_drafts = (
                (no_jump_forward, nothing_forced) if name == "one token per pass" else jump_forward)
            clock.seconds = 0.0
            t0 = time.perf_counter()
            outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            outputs.setdefault(name, [list(o.outputs[0].token_ids) for o in outs])
            stopped = stopped or [o.outputs[0].finish_reason == "stop" for o in outs]
            rates[name].append(n / dt)
            grammar[name].append(clock.seconds / n)
            step[name].append(sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
                              / max(1, n - len(outs)))
            spec = SpecDecodeStats()
            for o in outs:
                spec.merge(o.metrics.spec_decode)
            print(f"{name:>20}: decode {1.0 / step[name][-1]:6.2f} tok/s, with prefill {n / dt:6.2f} tok/s, "
                  f"grammar {1000 * clock.seconds / n:.2f} ms per token; {spec.num_drafts} drafts, "
                  f"{spec.num_draft_tokens} drafted, {spec.num_accepted_tokens} accepted, "
                  f"mean acceptance length {spec.mean_acceptance_length:.2f}", flush=True)
    decode = {k: 1.0 / min(v) for k, v in step.items()}  # each config's best round
    for k, v in decode.items():
        print(f"{k:>20}: best decode {v:6.2f} tok/s  {v / decode['constrained plain']:.2f}x constrained plain, "
              f"{v / decode['one token per pass']:.2f}x one token per pass")
    best = {k: max(v) for k, v in rates.items()}
    engine_module.constrain_proposal, engine_module.forced_drafts = jump_forward
    for k, v in best.items():
        print(f"{k:>20}: best with prefill {v:6.2f} tok/s  {v / best['constrained plain']:.2f}x constrained plain, "
              f"{v / best['one token per pass']:.2f}x one token per pass")
    g, t = min(grammar["constrained plain"]), min(step["constrained plain"])
    print(f"grammar time per token (plain): {1000 * g:.2f} ms, {100 * g / t:.1f}% of a plain decode step "
          f"({1000 * t:.1f} ms)")
    same = outputs["constrained plain"] == outputs["constrained default"] == outputs["one token per pass"]
    done = [t for t, s in zip(outputs["constrained default"], stopped) if s]
    valid = all(isinstance(json.loads(tok.decode(t, skip_special_tokens=True)), dict) for t in done)
    print(f"identical in all three configs: {same}; of the {len(done)} outputs that ended before "
          f"max_tokens, all parse as a JSON object: {valid}")


if __name__ == "__main__":
    main()
