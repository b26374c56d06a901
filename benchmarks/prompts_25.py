"""The 25 prompts of the long-prompt check, written as serve_compare.py's PROMPTS.jsonl ({"category", "prompt"}).

    python benchmarks/prompts_25.py OUT.jsonl
    python benchmarks/prompts_25.py --depths 0,2048,8192,16384,32000 OUT.jsonl


The first Spec-Bench prompt of each of its 13 categories (../shared/bench/spec_bench_questions.jsonl), then
twelve of our own that span prompt lengths from a few tokens to 8k: four short requests, a ~240-token extraction,
a RAG question over ~1,500 tokens of passages, a rename in a ~900-token method, tests for a ~150-token function,
and four documents of local Python source (1k, 2k, 4k and 8k tokens, counted with the default target's
tokenizer) with an explanation, a listing, a rename and an explanation asked about them. Every text is
built from this machine's files (the standard library), so the set is the same offline on any machine with
the same Python.

With ``--depths``, instead: one prompt per depth, the depth table's (0: a short coding request; otherwise a
document of local Python source of that many tokens with "explain the code above").
"""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC_BENCH = ROOT.parent / "shared" / "bench" / "spec_bench_questions.jsonl"

SHORT = [("short-greeting", "Hi! Who are you?"),
         ("short-arithmetic", "What is 17 * 23? Answer with the number only, then explain the steps."),
         ("short-code", "Write a Python one-liner that reverses the words of a sentence."),
         ("short-poem", "Write a haiku about compilers.")]

EXTRACTION = """Order #58213 was placed on 2024-03-14 by Dana Whitfield (dana.whitfield@example.com, +1 415 555
0142) for delivery to 88 Harbor Lane, Unit 4B, Portland, OR 97209. Items: two ceramic pour-over drippers at $24.50
each, one 1 kg bag of Ethiopian Yirgacheffe beans at $31.00, and a gooseneck kettle at $68.99. A 10% loyalty
discount applied to the beans only. Shipping was $7.95 by ground courier, estimated arrival 2024-03-19. The
customer asked that the parcel be left with the building concierge and paid with a Visa card ending 4471.

Extract every fact above as one JSON object with the keys order_id, date, customer (name, email, phone),
address, items (name, quantity, unit_price), discount, shipping, eta, instructions and payment."""


def _rag_prompt() -> str:
    import collections
    import functools
    import json as json_mod

    passages = [("json", inspect.getdoc(json_mod)), ("collections.OrderedDict", inspect.getdoc(collections.OrderedDict)),
                ("functools.lru_cache", inspect.getdoc(functools.lru_cache)),
                ("functools.partial", inspect.getdoc(functools.partial)),
                ("collections.Counter", inspect.getdoc(collections.Counter))]
    body = "\n\n".join(f"[{i + 1}] {name}\n{doc}" for i, (name, doc) in enumerate(passages))
    return (f"Answer using only the passages below, and cite the passage numbers you use.\n\n{body}\n\n"
            "Question: how would I cache the results of an expensive function, and how would I count how often "
            "each distinct argument was seen?")


def _rename_prompt() -> str:
    import textwrap

    src = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._wrap_chunks))
    return ("Rename the local variable `cur_line` to `current_line` everywhere in this method and return the "
            f"whole edited method.\n\n```python\n{src}```")


def _tests_prompt() -> str:
    import shlex

    return ("Write pytest unit tests for this function, covering its edge cases.\n\n```python\n"
            f"{inspect.getsource(shlex.join)}{inspect.getsource(shlex.quote)}```")


def own_twelve(count_tokens) -> list[tuple[str, str]]:
    from specdecode.bench.datasets import long_context_dataset

    out = list(SHORT) + [("extraction-order", EXTRACTION), ("rag-passages", _rag_prompt()),
                         ("edit-rename", _rename_prompt()), ("unit-tests", _tests_prompt())]
    # per_length 3 cycles the three tasks: explain, list, rename; one of each length, the task chosen
    for n, j in ((1024, 0), (2048, 1), (4096, 2), (8192, 0)):
        p = long_context_dataset([n], count_tokens, per_length=j + 1).prompts[j]
        out.append((f"document-{p.category}", p.text))
    return out


def depth_prompts(depths: list[int], count_tokens) -> list[tuple[str, str]]:
    from specdecode.bench.datasets import long_context_dataset

    out = []
    for n in depths:
        if n == 0:
            out.append(("depth-0", SHORT[2][1]))
        else:
            out.append((f"depth-{n}", long_context_dataset([n], count_tokens).prompts[0].text))
    return out


def main() -> None:
    args = sys.argv[1:]
    depths = None
    if len(args) == 3 and args[0] == "--depths":
        depths = [int(d) for d in args[1].split(",")]
        args = args[2:]
    if len(args) != 1:
        raise SystemExit(__doc__)
    from specdecode.models.default_models import default_model_path
    from specdecode.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(default_model_path("target"), True)

    def count(text: str) -> int:
        return len(tok.encode(apply_chat_template(tok, [{"role": "user", "content": text}])))

    rows = []
    if depths is not None:
        rows = depth_prompts(depths, count)
    else:
        seen = set()
        for line in SPEC_BENCH.read_text().splitlines():
            r = json.loads(line)
            if r["category"] not in seen:
                seen.add(r["category"])
                rows.append((f"spec-bench-{r['category']}", r["turns"][0]))
        rows += own_twelve(count)
    with open(args[0], "w") as f:
        for cat, prompt in rows:
            f.write(json.dumps({"category": cat, "prompt": prompt}) + "\n")
            print(f"{cat:>28}: {count(prompt):6d} tokens")


if __name__ == "__main__":
    main()
