"""The target model's trained context, read from its config before anything loads, and the check that a
max_model_len stays within it (vLLM refuses a longer one before loading)."""
from __future__ import annotations

import json
import os
from typing import Any


def model_context_length(model: str | None) -> int | None:
    """The target model's own maximum context, derived as vLLM does: its config's max_position_embeddings
    (n_positions, a GGUF's context_length), times the factor of a linear RoPE scaling. Read from the config
    alone, before anything loads; None when it cannot be read (loading the model then says what is wrong)."""
    try:
        from specdecode.models.families import FAMILIES, family_of
        from specdecode.models.resolve import resolve_model

        path = resolve_model(model, "target")
        if path.is_file():
            from specdecode.models.gguf_loader import read_gguf

            gguf = read_gguf(path)
            config = gguf.config
            gguf.close()
        else:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        family = family_of(config)
        args = FAMILIES[family].make_args(config, family)
    except Exception:  # noqa: BLE001 - the load that follows reports a missing or broken model properly
        return None
    from specdecode.models.loader import context_limit

    return context_limit(args)


def check_max_model_len(kw: dict[str, Any]) -> None:
    """A max_model_len beyond the model's own context is refused (as vLLM does) before the models load: its
    positions were never trained, and a huge value would only fail later, allocating the KV cache."""
    n = kw.get("max_model_len")
    if not isinstance(n, int) or os.environ.get("SPECDECODE_ALLOW_LONG_MAX_MODEL_LEN") == "1":
        return
    limit = model_context_length(kw.get("model"))
    if limit is not None and n > limit:
        raise ValueError(f"--max-model-len {n} is larger than the model's maximum context of {limit} tokens "
                         f"(max_position_embeddings / context_length in its config); use --max-model-len {limit} "
                         "or less.")
