"""Structured outputs: JSON schema, regex, choice and grammar constraints (xgrammar), exact under speculation."""
from specdecode.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GrammarCompiler", "Matcher"]


def __getattr__(name: str):
    # xgrammar is imported only when a constraint is compiled, so plain requests never pay for it.
    if name in ("GrammarCompiler", "Matcher"):
        from specdecode.structured import grammar
        return getattr(grammar, name)
    raise AttributeError(name)
