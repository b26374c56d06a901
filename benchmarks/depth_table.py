"""Decode and end-to-end time after a prompt of each depth: ours (default config) with speculation on and off,
llama-server plain and with a draft model, all servers up at once.

    python benchmarks/prompts_25.py --depths 0,2048,8192,16384,32000 depths.jsonl
    python benchmarks/depth_table.py out.json depths.jsonl --llama-bin $(bash ../shared/peers/build_llama_cpp.sh) \
        --target T.gguf --draft D.gguf [--draft-up-to 8192] [--depths depth-8192,depth-16384]

Each prompt goes first to ours with speculation on (a fresh prefill), then to ours again with
``speculative_decoding: false``: the prompt is in the prefix cache by then, so plain decoding's rate is timed
alone and its end-to-end time is taken as the first request's TTFT plus its own decode (the draft model's
prefill is lazy, so both requests' prefills are the same work). Then to llama-server plain and, up to
``--draft-up-to`` tokens, with the draft. Ours waits for its huge-page move to finish before the first prompt
(``specdecode:huge_pages_pending_bytes``). Greedy, streamed; each row is printed as it completes and the JSON
(with peak RSS of each server) is rewritten after every depth.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "peers"))
import serve_compare as sc  # ../shared/peers: server start/stop, chat format, peak RSS


def stream(base: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed completion; TTFT, decode tok/s after the first token, end-to-end seconds, tokens, text.
    No read timeout: a 32k prefill sends nothing for many minutes."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], None
    with urllib.request.urlopen(req, timeout=None) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(ch["text"])
    end = time.perf_counter()
    n = (usage or {}).get("completion_tokens") or len(text)
    decode = (n - 1) / (last - first) if first and last and last > first else float("nan")
    return {"ttft_s": (first or end) - t0, "e2e_s": end - t0, "tokens": n, "decode_tok_s": decode,
            "text": "".join(text)}


def _wait_for_huge_pages(base: str, limit: float = 600.0) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        metrics = sc._get(base + "/metrics", 10)[1].decode()
        line = next((x for x in metrics.splitlines() if x.startswith("specdecode:huge_pages_pending_bytes")), None)
        if line is None or float(line.split()[-1]) == 0:
            return
        time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("prompts", help="JSONL of {category, prompt} (prompts_25.py --depths)")
    ap.add_argument("--llama-bin", required=True, help="folder with llama-server")
    ap.add_argument("--target", required=True, help="target GGUF (ours serves the default pair)")
    ap.add_argument("--draft", required=True, help="draft GGUF for llama-server -md")
    ap.add_argument("--draft-up-to", type=int, default=8192, help="deepest prompt llama-server + draft gets")
    ap.add_argument("--depths", default="", help="comma list of categories to run (default: all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    want = set(filter(None, args.depths.split(",")))
    rows = [json.loads(x) for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    llama = f"{args.llama_bin}/llama-server -m {args.target} -t 2 -c 32768 -np 1 --port {{port}}"
    systems = {"ours": "specdecode serve --port {port}", "llama": llama,
               "llama_draft": llama.replace(" -t 2", f" -md {args.draft} --spec-type draft-simple -t 2")}
    up: dict[str, tuple] = {}
    res: dict = {"rows": []}
    try:
        for name, cmd in systems.items():
            _, _, base, proc = sc.start(args.out, f"{name}={cmd}")
            up[name] = (base, proc, None)
            res[f"{name}_load_s"] = sc.wait_healthy(base, proc)
            model = json.loads(sc._get(base + "/v1/models", 10)[1])["data"][0]["id"]
            up[name] = (base, proc, model)
            stream(base, model, sc.fmt("Say hello."), 16)
        _wait_for_huge_pages(up["ours"][0])
        for r in rows:
            if want and r["category"] not in want:
                continue
            depth = int(r["category"].rsplit("-", 1)[1])
            prompt, row = sc.fmt(r["prompt"]), {"depth": r["category"]}
            for name in ["ours", "llama"] + (["llama_draft"] if depth <= args.draft_up_to else []):
                base, _, model = up[name]
                row[name] = stream(base, model, prompt, args.max_tokens)
                if name == "ours":
                    plain = stream(base, model, prompt, args.max_tokens, {"speculative_decoding": False})
                    plain["e2e_s"] = row["ours"]["ttft_s"] + plain["e2e_s"] - plain["ttft_s"]
                    plain["same_text"] = plain["text"] == row["ours"]["text"]
                    row["ours_plain"] = plain
            for name, x in row.items():
                if name != "depth":
                    print(f"{r['category']:12s} {name:12s} ttft {x['ttft_s']:8.2f} decode {x['decode_tok_s']:6.2f} "
                          f"e2e {x['e2e_s']:8.2f} n={x['tokens']}", flush=True)
            res["rows"].append(row)
            res.update({f"{name}_peak_rss_gb": sc.peak_gb(proc) for name, (_, proc, _) in up.items()})
            Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        for _, proc, _ in up.values():
            sc.stop(proc)


if __name__ == "__main__":
    main()
