import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny import FAMILIES, build_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_models(tiny_dir) -> dict[str, Path]:
    """family -> HF directory of a tiny random model (2 layers, hidden 64, vocab 512)."""
    return {f: build_model(f, tiny_dir / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir) -> Path:
    """A smaller llama-family draft (1 layer, other seed) sharing the tiny tokenizer: differs from the target."""
    return build_model("llama", tiny_dir / "draft", seed=1, layers=1)
