"""Make a Q8_0 GGUF from another GGUF with the gguf package, and time it against the source.

Every matrix (a tensor of two or more dimensions whose rows hold whole blocks of 32) is decoded with gguf's
dequantization and requantized to Q8_0 with gguf's quantization, a slice of rows at a time; every other tensor
(norms, biases, RoPE factors) and all metadata are copied as they are, but for ``general.file_type``, which says
Q8_0 (and is added if missing). Reading the source's metadata with ``gguf.GGUFReader`` takes some seconds on a large vocabulary; that is the
converter's cost, not a loader's.

    python -m specdecode.bench.gguf_q8_0 SRC DST              # convert
    python -m specdecode.bench.gguf_q8_0 SRC DST --bench      # convert (if DST is missing), then time both

``--bench`` loads each file twice (converting into the packed-weight cache, then mapping the cached entry) and
times plain greedy decoding (no speculation) of the same prompts on both engines, interleaved round by round, so
that both see the same load from other processes; it reports each file's decode tok/s per round, the median, and
the Q8_0 / source ratio of every round (their spread says how noisy the machine was).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

_ROWS = 8192  # rows decoded and requantized at once: a 150k-row embedding table would take GBs of float32 whole


def _is_matrix(shape: tuple[int, ...]) -> bool:
    """GGUF order (innermost first): two or more dimensions, rows of whole Q8_0 blocks."""
    return len(shape) >= 2 and shape[0] % 32 == 0


def _to_q8_0(data: np.ndarray, qtype: int, row_len: int) -> np.ndarray:
    """A tensor's stored data (as ``GGUFReader`` gives it) requantized to Q8_0 bytes, one row of blocks per row."""
    import gguf

    from specdecode.models.gguf_loader import dequantize

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    rows = np.ascontiguousarray(data).view(np.uint8).reshape(-1, row_len // block * type_size)
    out = np.empty((rows.shape[0], row_len // 32 * 34), dtype=np.uint8)
    for r0 in range(0, rows.shape[0], _ROWS):
        values = dequantize(rows[r0:r0 + _ROWS], qtype, row_len).view(-1, row_len).numpy()
        out[r0:r0 + _ROWS] = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    return out


def convert(src: str | Path, dst: str | Path) -> dict:
    """Write ``dst``, the Q8_0 version of GGUF ``src``; returns what was done (tensor counts, seconds)."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFValueType

    t0 = time.perf_counter()
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment"):
            continue  # the header's own fields, and what the writer sets itself
        vtype = field.types[0]
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_Q8_0)
        writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY
                             else None)
    if "general.file_type" not in reader.fields:
        writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    requantized = kept = 0
    for t in reader.tensors:
        shape = tuple(int(d) for d in t.shape)
        if _is_matrix(shape) and t.tensor_type != GGMLQuantizationType.Q8_0:
            q = _to_q8_0(t.data, int(t.tensor_type), shape[0])
            writer.add_tensor(t.name, q.reshape(*reversed(shape[1:]), -1), raw_dtype=GGMLQuantizationType.Q8_0)
            requantized += 1
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            kept += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"requantized": requantized, "kept": kept, "seconds": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------------------------------------------ bench
_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain what a hash map is and give a short example in Python.",
    "def quicksort(xs):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
]


def _load(path: Path, packed_cache: bool):
    """(engine, seconds to build it) for plain decoding of ``path``."""
    import os

    from specdecode import LLM

    prev = os.environ.get("SPECDECODE_PACKED_CACHE")
    os.environ["SPECDECODE_PACKED_CACHE"] = "1" if packed_cache else "0"
    try:
        t0 = time.perf_counter()
        llm = LLM(str(path), max_model_len=1024, speculative_config={"method": "none"})
        return llm, time.perf_counter() - t0
    finally:
        if prev is None:
            os.environ.pop("SPECDECODE_PACKED_CACHE", None)
        else:
            os.environ["SPECDECODE_PACKED_CACHE"] = prev


def _decode_rate(llm, max_tokens: int, prompts: list[str]) -> float:
    """Decode tokens/s over the prompts (time after each one's first token, which prefill produces)."""
    from specdecode import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = seconds = 0.0
    for prompt in prompts:
        out = llm.generate([prompt], sampling_params=params, use_tqdm=False)[0]
        m = out.metrics
        tokens += len(out.outputs[0].token_ids) - 1
        seconds += m.finished_time - m.first_token_time
    return tokens / seconds


def bench(src: Path, dst: Path, rounds: int, max_tokens: int, num_prompts: int = len(_PROMPTS),
          convert_load: bool = True) -> dict:
    """Load times (converting, unless ``convert_load`` is False, and from the packed cache) and interleaved decode
    rates of ``src`` and ``dst``."""
    files = {"source": src, "q8_0": dst}
    prompts = _PROMPTS[:num_prompts]
    result: dict = {"files": {k: str(v) for k, v in files.items()}, "load_convert_s": {}, "load_cached_s": {}}
    engines = {}
    for name, path in files.items():
        if convert_load:
            llm, secs = _load(path, packed_cache=False)
            result["load_convert_s"][name] = round(secs, 2)
            print(json.dumps({"load_convert_s": {name: round(secs, 2)}}), flush=True)
            del llm
        _load(path, packed_cache=True)  # writes the cache entry if it is missing
        engines[name], secs = _load(path, packed_cache=True)
        result["load_cached_s"][name] = round(secs, 2)
        model = engines[name].llm_engine.target.model
        result.setdefault("weight_formats", {})[name] = dict(Counter(
            m.packed.fmt for m in model.modules() if getattr(m, "packed", None) is not None))
    print(json.dumps({k: result[k] for k in ("load_cached_s", "weight_formats")}), flush=True)
    for llm in engines.values():  # warm-up
        _decode_rate(llm, 8, prompts[:1])
    rates: dict[str, list[float]] = {name: [] for name in files}
    for r in range(rounds):
        order = list(files) if r % 2 == 0 else list(reversed(files))
        for name in order:
            rates[name].append(_decode_rate(engines[name], max_tokens, prompts))
        print(json.dumps({"round": r, **{k: round(v[-1], 2) for k, v in rates.items()}}), flush=True)
    ratios = [q / s for q, s in zip(rates["q8_0"], rates["source"])]
    result.update({
        "decode_tok_s": {k: [round(v, 2) for v in vs] for k, vs in rates.items()},
        "decode_tok_s_median": {k: round(statistics.median(vs), 2) for k, vs in rates.items()},
        "q8_0_over_source_per_round": [round(x, 3) for x in ratios],
        "q8_0_over_source_median": round(statistics.median(ratios), 3),
        "max_tokens": max_tokens, "rounds": rounds, "prompts": len(prompts),
    })
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdecode.bench.gguf_q8_0", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="source GGUF (e.g. the default target, Q4_K_M)")
    ap.add_argument("dst", type=Path, help="Q8_0 GGUF to write")
    ap.add_argument("--bench", action="store_true", help="then time loading and plain decoding of both files")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    ap.add_argument("--num-prompts", type=int, default=len(_PROMPTS), choices=range(1, len(_PROMPTS) + 1),
                    help=f"prompts per round (default {len(_PROMPTS)})")
    ap.add_argument("--no-convert-load", action="store_true",
                    help="skip the load with the packed cache off (the full conversion: minutes on a busy machine)")
    ap.add_argument("--output-json", type=Path, default=None)
    a = ap.parse_args(argv)
    if not a.src.is_file():
        print(f"error: {a.src} is not a file", file=sys.stderr)
        return 2
    out: dict = {}
    if not (a.bench and a.dst.exists()):
        out["convert"] = convert(a.src, a.dst)
        print(json.dumps(out["convert"]), flush=True)
    if a.bench:
        out["bench"] = bench(a.src, a.dst, a.rounds, a.max_tokens, a.num_prompts, not a.no_convert_load)
        print(json.dumps(out["bench"], indent=1))
    if a.output_json:
        a.output_json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
