import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from specdecode.models.default_models import DEFAULT_MODELS, cache_dir  # noqa: E402
from tiny import FAMILIES, build_model  # noqa: E402

# Under pytest-xdist the controller makes the session's cache and its workers (started with its environment)
# share it, so that the default pair is converted once per run, not once per worker.
USER_CACHE = Path(os.environ.get("SPECDECODE_TEST_USER_CACHE") or cache_dir())


def _session_cache(user: Path) -> Path:
    """A temporary $SPECDECODE_CACHE for the whole session, set before anything loads and inherited by the
    commands the tests start: the packed entries, tokenizers and calibrations the tests make go there, never into
    the user's cache. The default pair is the exception: its GGUF files are links to the user's cache, where they
    are assembled once as ``specdecode generate`` would, and the user's packed entries and tokenizers of that pair
    are linked in so that a session reads them instead of converting the pair again."""
    if os.environ.get("SPECDECODE_TEST_SESSION_CACHE"):  # an xdist worker: the controller's
        return Path(os.environ["SPECDECODE_TEST_SESSION_CACHE"])
    session = Path(tempfile.mkdtemp(prefix="specdecode-tests-"))
    atexit.register(shutil.rmtree, session, ignore_errors=True)
    os.environ["SPECDECODE_TEST_SESSION_CACHE"], os.environ["SPECDECODE_TEST_USER_CACHE"] = str(session), str(user)
    for spec in DEFAULT_MODELS.values():
        (session / spec.filename).symlink_to(user / spec.filename)
        stem = spec.filename.removesuffix(".gguf")
        for sub, pattern in (("packed", f"{stem}.*.spk"), ("tokenizers", f"{stem}.*")):
            (session / sub).mkdir(exist_ok=True)
            for found in (user / sub).glob(pattern):
                (session / sub / found.name).symlink_to(found)
    return session


SESSION_CACHE = _session_cache(USER_CACHE)
os.environ["SPECDECODE_CACHE"] = str(SESSION_CACHE)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share two cores: in-process torch work takes one thread each, since two 2-thread pools on two
    # cores spin against each other (tests that check other thread counts set their own).
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def user_cache() -> Path:
    """The user's cache folder (their $SPECDECODE_CACHE, else ~/.cache/specdecode), which the session does not use."""
    return USER_CACHE


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
