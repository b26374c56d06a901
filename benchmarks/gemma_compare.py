"""Gemma 3 270M served by specdecode and by llama-server, side by side.

The shared comparison tool (../shared/peers/serve_compare.py) formats prompts in Qwen's chat format; this wrapper
swaps in Gemma's turn format and otherwise runs the same tool, so the figures are comparable with its other runs.

    INTERLEAVE=1 python benchmarks/gemma_compare.py OUT.json PROMPTS.jsonl NAME='CMD with {port}' ...

Each server adds the model's BOS token itself, so the prompt text starts at the first turn.
"""
from __future__ import annotations

import os
import sys

PEERS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "peers")


def gemma_turns(question: str) -> str:
    return f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"


if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("PEERS_DIR", PEERS))
    import serve_compare

    serve_compare.fmt = gemma_turns
    serve_compare.main()
