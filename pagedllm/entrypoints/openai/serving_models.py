"""The models a server answers to: the base model's served names and LoRA adapters (``--lora-modules``
at start-up, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` at run time). A request's
``model`` picks one; an adapter's name runs the request with that adapter.

Run-time loading is off unless the operator turns it on (``--allow-runtime-lora-updating`` or
``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING``, vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a client that may load
adapters may make the server read any folder it can read. Even then the ``--lora-modules`` adapters are the
operator's: no client unloads or replaces them."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
from dataclasses import dataclass

from pagedllm import envs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.errors import ValidationError, quoted
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.lora_request import LoRARequest


class ModelNotFoundError(Exception):
    """The request names a model (or adapter) this server does not serve (HTTP 404)."""

    def __init__(self, model: str, param: str = "model") -> None:
        super().__init__(f"the model {quoted(model)} does not exist on this server")
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


RUNTIME_LORA_ENV = envs.ALLOW_RUNTIME_LORA_UPDATING.name
"""1 or true: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""


def runtime_lora_updating(flag: bool) -> bool:
    """Whether clients may load and unload adapters: ``--allow-runtime-lora-updating`` (``flag``) or
    PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1/true; off by default. Another value of the variable is refused."""
    on = envs.ALLOW_RUNTIME_LORA_UPDATING.read()  # read (and checked) even when the flag is given
    return flag or on


def public_name(path: str) -> str:
    """A model's or adapter's folder (or file) as /v1/models shows it: its last component, so the server's
    filesystem layout is not shown to every client (vLLM shows the path as given)."""
    return os.path.basename(path.rstrip("/" + os.sep)) or path


class OpenAIServingModels:
    """Served names of the base model, and the adapters by name."""

    def __init__(self, engine: AsyncLLM, base_names: list[str], aliases: list[str] | None = None) -> None:
        """``aliases``: other names a request's ``model`` may give the base model, never listed (the model
        argument as given, when the served name is its public_name: clients that sent the path still work)."""
        self.engine = engine
        self.base_names = base_names
        self.aliases = set(aliases or ()) - set(base_names)
        self.loras: dict[str, LoRARequest] = {}
        self.static: set[str] = set()
        """The --lora-modules names: the operator's, never unloaded or replaced by a client."""
        self._busy: set[str] = set()
        """Names a load or unload is changing now: a second change of one of them is refused, so concurrent
        loads of one name leave exactly one adapter in the engine."""
        self._ids = itertools.count(1)
        self.root = public_name(engine.config.model.model)
        self.max_model_len = engine.config.model.max_model_len

    def add_static(self, modules: list[LoRAModulePath]) -> None:
        """The --lora-modules adapters, read and checked before the engine loop starts."""
        for module in modules:
            self._check_new_name(module.name)
            lora = LoRARequest(module.name, next(self._ids), module.path)
            self.engine.add_lora_now(lora)
            self.loras[module.name] = lora
            self.static.add(module.name)

    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(name to answer with, the adapter to run or None) for a request's ``model``."""
        if model is None or model == "":
            return self.base_names[0], None
        if model in self.base_names:
            return model, None
        if model in self.aliases:
            return self.base_names[0], None  # (answered with the listed name: the path is not echoed)
        if model in self.loras:
            return model, self.loras[model]
        raise ModelNotFoundError(model)

    def cards(self) -> list[ModelCard]:
        """/v1/models: the base model's names, then each adapter (its parent: the base model)."""
        base = [ModelCard(id=name, root=self.root, max_model_len=self.max_model_len) for name in self.base_names]
        return base + [ModelCard(id=name, root=public_name(lora.lora_path), parent=self.base_names[0],
                                 max_model_len=self.max_model_len) for name, lora in self.loras.items()]

    async def load(self, name: str, path: str) -> LoRARequest:
        """Add an adapter at run time (the engine reads and checks it between two steps). 400 when the name is
        served or being loaded: of concurrent loads of one name exactly one reaches the engine."""
        if not name:
            raise ValidationError.bad_value("lora_name", name, "a non-empty string")
        if not path:
            raise ValidationError.bad_value("lora_path", path, "the folder of a PEFT adapter")
        if name in self.static:
            raise ValidationError(f"{quoted(name)} is configured by the server's operator and cannot be replaced",
                                  param="lora_name", value=name)
        self._check_new_name(name)
        lora = LoRARequest(name, next(self._ids), path)
        self._busy.add(name)
        # shielded: a client gone mid-load must not leave the adapter in the engine but not in self.loras
        return await asyncio.shield(self._add(lora))

    async def _add(self, lora: LoRARequest) -> LoRARequest:
        try:
            await self.engine.add_lora(lora)
            self.loras[lora.lora_name] = lora
        finally:
            self._busy.discard(lora.lora_name)
        return lora

    async def unload(self, name: str, lora_int_id: int | None = None) -> None:
        """Remove a run-time adapter no running request uses: 400 for an operator's (--lora-modules) adapter or
        a base model name, 404 if there is none by that name."""
        if name in self.static or name in self.base_names:
            what = "the base model" if name in self.base_names else "configured by the server's operator"
            raise ValidationError(f"{quoted(name)} is {what} and cannot be unloaded", param="lora_name", value=name)
        if name in self._busy:
            raise ValidationError(f"adapter {quoted(name)} is being loaded or unloaded by another request",
                                  param="lora_name", value=name)
        lora = self.loras.get(name)
        if lora is None:
            raise ModelNotFoundError(name, param="lora_name")
        if lora_int_id is not None and lora_int_id != lora.lora_int_id:
            raise ValidationError(f"adapter {quoted(name)} has lora_int_id {lora.lora_int_id}", param="lora_int_id",
                                  value=lora_int_id)
        self._busy.add(name)
        del self.loras[name]  # new requests no longer find it while the engine removes it
        await asyncio.shield(self._remove(lora))

    async def _remove(self, lora: LoRARequest) -> None:
        try:
            await self.engine.remove_lora(lora.lora_int_id)
        except BaseException:
            self.loras[lora.lora_name] = lora  # still in use (or the engine failed): it stays served
            raise
        finally:
            self._busy.discard(lora.lora_name)

    def _check_new_name(self, name: str) -> None:
        if name in self.base_names or name in self.aliases or name in self.loras or name in self._busy:
            raise ValidationError(f"a model or adapter named {quoted(name)} is already in use", param="lora_name",
                                  value=name)
