"""The models a server answers to: the base model's served names and LoRA adapters (``--lora-modules``
at start-up, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` at run time). A request's
``model`` picks one; an adapter's name runs the request with that adapter.

Run-time loading is off unless the operator turns it on (``--allow-runtime-lora-updating`` or
``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING``, vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a client that may load
adapters may make the server read any folder it can read. Even then the ``--lora-modules`` adapters are the
operator's: no client unloads or replaces them. As vLLM: a folder without an adapter_config.json is a 404, a name
already loaded a 400 unless the load says ``load_inplace`` (the new adapter then replaces it)."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
from dataclasses import dataclass

from pagedllm import envs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.errors import ValidationError, quoted
from pagedllm.lora_request import ADAPTER_CONFIG_FILE, LoRARequest


class ModelNotFoundError(Exception):
    """The request names a model (or adapter) this server does not serve (HTTP 404)."""

    code = "model_not_found"

    def __init__(self, model: str, param: str = "model", message: str | None = None) -> None:
        super().__init__(message or f"the model {quoted(model)} does not exist on this server")
        self.model = model
        self.param = param


class AdapterNotFoundError(ModelNotFoundError):
    """A load names a folder with no adapter in it: no adapter_config.json there, or no such folder (HTTP 404, as
    vLLM's; the two are one answer, so a client learns nothing of which folders exist)."""

    code = "adapter_not_found"

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name, "lora_path", f"no LoRA adapter found for {quoted(name)} at {quoted(path, 256)}: "
                                            f"no {ADAPTER_CONFIG_FILE} there")


RETIRE_POLL_S = 0.5
"""Seconds between tries to remove an adapter a load_inplace replaced while requests still ran with it."""


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None
    """vLLM's JSON key: the served name /v1/models gives as the adapter's parent (default: the first one)."""


LORA_MODULE_KEYS = ("name", "path", "base_model_name", "is_3d_lora_weight")
"""The keys of vLLM's JSON form of a --lora-modules entry (is_3d_lora_weight: false only)."""


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}`` (argparse type)."""
    base = None
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: {text!r} is not valid JSON ({e})") from None
        if not isinstance(entry, dict):
            raise argparse.ArgumentTypeError(f"--lora-modules: {text!r} is not a JSON object")
        unknown = sorted(set(entry) - set(LORA_MODULE_KEYS))
        if unknown:
            raise argparse.ArgumentTypeError(f"--lora-modules: {unknown} not supported (the keys: "
                                             f"{list(LORA_MODULE_KEYS)})")
        if entry.get("is_3d_lora_weight", False) is not False:
            raise argparse.ArgumentTypeError("--lora-modules: is_3d_lora_weight (a MoE adapter's 3D weights) is not "
                                             "supported: false only")
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        if base is not None and (not isinstance(base, str) or not base):
            raise argparse.ArgumentTypeError(f"--lora-modules: base_model_name must be a served model name, got "
                                             f"{base!r}")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path or {{\"name\": ..., \"path\": ...}}, "
                                         f"got {text!r}")
    return LoRAModulePath(name, path, base)


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
        self.parents: dict[str, str] = {}
        """An adapter's parent in /v1/models when it is not the first served name (--lora-modules'
        base_model_name)."""
        self._retiring: set[asyncio.Task] = set()
        """Removals of adapters a load_inplace replaced, waiting for the requests that still use them."""
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
            if module.base_model_name is not None and module.base_model_name not in self.base_names:
                raise ValidationError(f"--lora-modules {quoted(module.name)}: base_model_name "
                                      f"{quoted(module.base_model_name)} is not a served model name "
                                      f"({self.base_names})", param="lora_modules", value=module.base_model_name)
            lora = LoRARequest(module.name, next(self._ids), module.path)
            self.engine.add_lora_now(lora)
            self.loras[module.name] = lora
            self.static.add(module.name)
            if module.base_model_name is not None:
                self.parents[module.name] = module.base_model_name

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
        return base + [ModelCard(id=name, root=public_name(lora.lora_path),
                                 parent=self.parents.get(name, self.base_names[0]), max_model_len=self.max_model_len)
                       for name, lora in self.loras.items()]

    async def load(self, name: str, path: str, load_inplace: bool = False) -> LoRARequest:
        """Add an adapter at run time (the engine reads and checks it between two steps). 400 when the name is
        a base model's or being loaded, or already loaded without ``load_inplace``: of concurrent loads of one name
        exactly one reaches the engine. 404 (AdapterNotFoundError) when ``path`` holds no adapter_config.json.

        ``load_inplace``: an adapter of that name is replaced once the new one is read and checked; the new one
        gets a new id (its own prefix-cache entries: nothing computed with the old weights is reused), and the old
        one leaves the engine when the requests that run with it are done."""
        if not name:
            raise ValidationError.bad_value("lora_name", name, "a non-empty string")
        if not path:
            raise ValidationError.bad_value("lora_path", path, "the folder of a PEFT adapter")
        if name in self.static:
            raise ValidationError(f"{quoted(name)} is configured by the server's operator and cannot be replaced",
                                  param="lora_name", value=name)
        if name in self.loras and name not in self._busy:
            if not load_inplace:
                raise ValidationError(f"the LoRA adapter {quoted(name)} has already been loaded (to replace it, "
                                      "load it with load_inplace: true)", param="lora_name", value=name)
        else:
            self._check_new_name(name)
        if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG_FILE)):
            raise AdapterNotFoundError(name, path)
        lora = LoRARequest(name, next(self._ids), path)
        self._busy.add(name)
        # shielded: a client gone mid-load must not leave the adapter in the engine but not in self.loras
        return await asyncio.shield(self._add(lora))

    async def _add(self, lora: LoRARequest) -> LoRARequest:
        try:
            await self.engine.add_lora(lora)
            old = self.loras.get(lora.lora_name)
            self.loras[lora.lora_name] = lora
        finally:
            self._busy.discard(lora.lora_name)
        if old is not None:
            task = asyncio.get_running_loop().create_task(self._retire(old))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return lora

    async def _retire(self, lora: LoRARequest) -> None:
        """Remove a replaced adapter from the engine once no request runs with it (tried every RETIRE_POLL_S);
        given up when the engine stops."""
        while self.engine.is_running:
            try:
                await self.engine.remove_lora(lora.lora_int_id)
                return
            except ValidationError:  # still in use
                await asyncio.sleep(RETIRE_POLL_S)
            except Exception:  # the engine stopped: nothing left to free
                return

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
        """400 unless ``name`` is free for a new adapter."""
        if name in self.base_names or name in self.aliases:
            raise ValidationError(f"{quoted(name)} is a served base model's name: an adapter cannot take it",
                                  param="lora_name", value=name)
        if name in self._busy:
            raise ValidationError(f"adapter {quoted(name)} is being loaded or unloaded by another request",
                                  param="lora_name", value=name)
        if name in self.loras:
            raise ValidationError(f"the LoRA adapter {quoted(name)} has already been loaded", param="lora_name",
                                  value=name)
