"""The C++ kernels of another revision against the working tree's, on one loaded engine, alternated per prompt.

Builds the kernel's C++ sources as they were at ``--base`` (a git revision) and as they are now, loads
the default pair once, and decodes one Spec-Bench prompt per category with each build in turn (the order
swapped every prompt, so that a noisy machine's slow minutes fall on both): first with the default speculative
config, then with speculation off. Greedy outputs must be identical (the kernels compute the same bits).
Prints tok/s per build and mode and their ratio.

    python benchmarks/bench_kernel_ab.py --base HEAD~1
    python benchmarks/bench_kernel_ab.py --base 4da4eae --rounds 3 --prompts 13 --modes none
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import load_dataset
from specdecode.layers.kernels import extension

ROOT = Path(__file__).resolve().parent.parent
# Where the sources lived: split by format and role into csrc/, before that one file.
SOURCE_DIRS = ("specdecode/layers/kernels/csrc", "specdecode/layers")
QUESTIONS = ROOT.parent / "shared" / "bench" / "spec_bench_questions.jsonl"


def base_sources(rev: str, into: Path) -> list[Path]:
    """The kernel's sources at ``rev`` (its .cpp and .h files), written to ``into``; the .cpp files."""
    for d in SOURCE_DIRS:
        names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{d}"],
                               capture_output=True, text=True).stdout.split()
        names = [n for n in names if n.endswith((".cpp", ".h"))]
        if names:
            for n in names:
                (into / n).write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{d}/{n}"],
                                                      check=True, capture_output=True).stdout)
            return sorted(into / n for n in names if n.endswith(".cpp"))
    raise SystemExit(f"no kernel sources at {rev}")


def build(sources: list[Path], build_root: Path):
    """The kernel module built from ``sources`` with the flags the package uses (native first)."""
    from torch.utils import cpp_extension

    digest = hashlib.sha1()
    for path in sorted(sources[0].parent.glob("*.[ch]*")):
        digest.update(path.name.encode() + path.read_bytes())
    name = "kernel_ab_" + digest.hexdigest()[:12]
    directory = build_root / name
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cpp_extension.load(name=name, sources=[str(s) for s in sources],
                                  extra_cflags=extension._BUILD_ATTEMPTS[0], extra_ldflags=["-fopenmp"],
                                  build_directory=str(directory), verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision whose kernel source is the baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6, help="Spec-Bench categories, one prompt each")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--questions", type=Path, default=QUESTIONS)
    ap.add_argument("--modes", default="default,none", help="default (speculative) and/or none (plain)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "base").mkdir()
        base_src = base_sources(args.base, Path(tmp) / "base")
        build_root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path(tmp) / "builds"))
        builds = {"base": build(base_src, build_root), "now": build([Path(s) for s in extension._SOURCES], build_root)}
        llm = LLM()
        engine = llm.llm_engine
        spec = engine.config.speculative
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        chats = [[{"role": "user", "content": p.text}]  # the first prompt of each category
                 for p in load_dataset(str(args.questions), 1).prompts[:args.prompts]]
        for mode in args.modes.split(","):
            engine.set_speculative(spec if mode == "default" else {"method": "none"})
            tokens = {name: 0 for name in builds}
            seconds = {name: 0.0 for name in builds}
            for rnd in range(args.rounds):
                for i, chat in enumerate(chats):
                    order = list(builds) if (rnd + i) % 2 == 0 else list(reversed(builds))
                    outputs = {}
                    for name in order:
                        extension._ext = builds[name]
                        t0 = time.perf_counter()
                        out = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
                        seconds[name] += time.perf_counter() - t0
                        tokens[name] += len(out.token_ids)
                        outputs[name] = out.token_ids
                    if outputs["base"] != outputs["now"]:
                        raise SystemExit(f"outputs differ on prompt {i} ({mode}): the kernels are not exact")
            rate = {name: tokens[name] / seconds[name] for name in builds}
            print(f"{mode:8s} base {rate['base']:6.2f} tok/s   now {rate['now']:6.2f} tok/s   "
                  f"now/base {rate['now'] / rate['base']:.3f}", flush=True)


if __name__ == "__main__":
    main()
