"""``/v1/models``: the served model names (OpenAI's list and retrieve)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from specdecode.entrypoints.openai.response_models import ModelCard, ModelList
from specdecode.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingModels(OpenAIServing):
    """The model cards of the served names."""

    def card(self, name: str) -> ModelCard:
        return ModelCard(id=name, root=self.model_path, max_model_len=self.engine.max_model_len)

    def list_models(self) -> dict:
        return ModelList(data=[self.card(name) for name in self.names]).model_dump()

    def retrieve(self, model_id: str) -> dict:
        # the card of a served name (or of the model path a request may name)
        return self.card(model_id if model_id in self.names else self.check_model(model_id)).model_dump()


def register(app: FastAPI, **serving_args: Any) -> None:
    serving = OpenAIServingModels(**serving_args)

    @app.get("/v1/models")
    async def models() -> dict:
        return serving.list_models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        return serving.retrieve(model_id)
