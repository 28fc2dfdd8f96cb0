"""The models a server answers to: the base model's served names and LoRA adapters (``--lora-modules``
at start-up, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` at run time). A request's
``model`` picks one; an adapter's name runs the request with that adapter."""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

from pagedllm.engine.core_client import ServingEngine
from pagedllm.errors import ValidationError
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.lora_request import LoRARequest


class ModelNotFoundError(Exception):
    """The request names a model (or adapter) this server does not serve (HTTP 404)."""

    def __init__(self, model: str, param: str = "model") -> None:
        super().__init__(f"the model {model!r} does not exist on this server")
        self.model = model
        self.param = param


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry."""

    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...}`` (argparse type)."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: {text!r} is not valid JSON ({e})") from None
        name, path = entry.get("name"), entry.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path or {{\"name\": ..., \"path\": ...}}, "
                                         f"got {text!r}")
    return LoRAModulePath(name, path)


class OpenAIServingModels:
    """Served names of the base model, and the adapters by name."""

    def __init__(self, engine: ServingEngine, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = base_names
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self.root = engine.config.model.model
        self.max_model_len = engine.config.model.max_model_len

    def add_static(self, modules: list[LoRAModulePath]) -> None:
        """The --lora-modules adapters, read and checked before the engine loop starts."""
        for module in modules:
            self._check_new_name(module.name)
            lora = LoRARequest(module.name, next(self._ids), module.path)
            self.engine.add_lora_now(lora)
            self.loras[module.name] = lora

    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(name to answer with, the adapter to run or None) for a request's ``model``."""
        if model is None or model == "":
            return self.base_names[0], None
        if model in self.base_names:
            return model, None
        if model in self.loras:
            return model, self.loras[model]
        raise ModelNotFoundError(model)

    def cards(self) -> list[ModelCard]:
        """/v1/models: the base model's names, then each adapter (its parent: the base model)."""
        base = [ModelCard(id=name, root=self.root, max_model_len=self.max_model_len) for name in self.base_names]
        return base + [ModelCard(id=name, root=lora.lora_path, parent=self.base_names[0],
                                 max_model_len=self.max_model_len) for name, lora in self.loras.items()]

    async def load(self, name: str, path: str) -> LoRARequest:
        """Add an adapter at run time (the engine reads and checks it between two steps)."""
        self._check_new_name(name)
        lora = LoRARequest(name, next(self._ids), path)
        await self.engine.add_lora(lora)
        self.loras[name] = lora
        return lora

    async def unload(self, name: str) -> None:
        """Remove an adapter no running request uses (404 if there is none by that name)."""
        lora = self.loras.get(name)
        if lora is None:
            raise ModelNotFoundError(name, param="lora_name")
        await self.engine.remove_lora(lora.lora_int_id)
        del self.loras[name]

    def _check_new_name(self, name: str) -> None:
        if name in self.base_names or name in self.loras:
            raise ValidationError(f"a model or adapter named {name!r} is already served", param="lora_name",
                                  value=name)
