"""A stand-in ``vllm`` package holding only what a test that talks to a server imports to set itself up: the
platform (no GPU), the hub client (anything fetched skips the test), a tokenizer of the stand-in model, a free
port, a logger. Any other ``vllm.*`` module imports, but each name taken from it is a placeholder that raises
``VllmInternal`` when used: a test that uses vLLM's own code (its protocol classes, engine, offline ``LLM``)
exercises vLLM, not its server, and is counted as not reaching the server, while the other tests of its file
still run."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import re
import shutil
import socket
import sys
import types
from pathlib import Path
from typing import Any

import pytest

INTERNAL = "vLLM internals"


class VllmInternal(Exception):
    """A test used a name of vLLM's own code (the shim serves none)."""


class _Internal:
    """A name imported from vLLM's code: any use raises VllmInternal naming it."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise VllmInternal(f"uses {object.__getattribute__(self, '_name')}, one of {INTERNAL}")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        self._refuse()

    __call__ = __getitem__ = __iter__ = __mro_entries__ = __bool__ = __len__ = __contains__ = _refuse

    def __repr__(self) -> str:
        return f"<vLLM's {object.__getattribute__(self, '_name')}>"


def _placeholders(module: str) -> Any:
    """A module's ``__getattr__`` handing out placeholders."""
    def getattr_(name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Internal(f"{module}.{name}")
    return getattr_


class _Platform:
    """``current_platform``: a CPU with no GPU; every ``is_*`` question answers False except ``is_cpu``."""

    device_type = "cpu"
    device_name = "cpu"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("is_"):
            return lambda *a, **k: name == "is_cpu"
        if name.startswith("has_") or name.startswith("supports_"):
            return lambda *a, **k: False
        raise AttributeError(name)

    def get_device_capability(self, *args: Any, **kwargs: Any) -> None:
        """No GPU: no capability."""
        return None

    def get_device_name(self, *args: Any, **kwargs: Any) -> str:
        """The device's name."""
        return "cpu"


#: Hub repositories of LoRA adapters vLLM's server tests load (matched on the name): the shim writes a LoRA
#: adapter of the same shape for the stand-in model instead (lora_B zero: the base model's outputs).
LORA_REPOS = re.compile(r".*(lora|LoRA|self_cognition_Alice).*")


def make_adapter(repo_id: str, base: str, rank: int = 8) -> str:
    """A PEFT adapter folder for ``base`` (the stand-in model) under the cache, made once: q/k/v/o projections
    of every layer, lora_A random, lora_B zero (so the outputs are the base model's; the tests check the
    adapter's plumbing, names and listing, not its weights)."""
    import json

    import torch
    from safetensors.torch import save_file

    from pagedllm.models.loader import load_arch_config

    cache = Path.home() / ".cache" / "pagedllm-bench" / "vllm-tests" / "adapters" / repo_id.replace("/", "--")
    if (cache / "adapter_model.safetensors").exists():
        return str(cache)
    c = load_arch_config(base)
    outs = {"q_proj": c.num_heads * c.head_dim, "k_proj": c.num_kv_heads * c.head_dim,
            "v_proj": c.num_kv_heads * c.head_dim, "o_proj": c.hidden_size}
    ins = {"q_proj": c.hidden_size, "k_proj": c.hidden_size, "v_proj": c.hidden_size,
           "o_proj": c.num_heads * c.head_dim}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(c.num_layers):
        for name, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, ins[name], generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.zeros(out, rank)
    aside = cache.with_name(cache.name + f".{os.getpid()}")
    aside.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(aside / "adapter_model.safetensors"))
    (aside / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(outs),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": repo_id}))
    try:
        os.rename(aside, cache)
    except OSError:  # made meanwhile by another run
        shutil.rmtree(aside, ignore_errors=True)
    return str(cache)


class _HubApi:
    """``hf_api()``: a LoRA adapter's repository becomes a local adapter for the stand-in model (make_adapter);
    every other call skips the test (nothing is fetched from the hub)."""

    def __getattr__(self, name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            what = str(kwargs.get("repo_id") or (args[0] if args else ""))
            if name == "snapshot_download" and LORA_REPOS.fullmatch(what):
                from pagedllm.models.loader import default_model_path

                return make_adapter(what, default_model_path())
            pytest.skip(f"[hub] needs {what} from the Hugging Face hub ({name}); nothing is fetched")
        return refuse


def _get_tokenizer(tokenizer_name: str, *args: Any, **kwargs: Any) -> Any:
    """The stand-in model's tokenizer for a vLLM test model's name (skips when there is no stand-in)."""
    from pagedllm.models.loader import load_tokenizer

    from .translate import Refused, local_model

    try:
        path, _ = local_model(str(tokenizer_name))
    except Refused as e:
        pytest.skip(e.reason)
    return load_tokenizer(path)


def _get_open_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(name: str) -> Any:
    """``vllm.envs.NAME``: False for every VLLM_* switch (vLLM's optional paths, e.g. its Rust front end, are
    not ours)."""
    if name.startswith("VLLM_"):
        return False
    raise AttributeError(name)


def _modules() -> dict[str, dict[str, Any]]:
    """The stand-in modules: name -> attributes."""
    return {
        "vllm": {},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.transformers_utils": {},
        "vllm.transformers_utils.repo_utils": {"hf_api": lambda *a, **k: _HubApi()},
        "vllm.tokenizers": {"get_tokenizer": _get_tokenizer},
        "vllm.utils": {},
        "vllm.utils.network_utils": {"get_open_port": _get_open_port},
        "vllm.logger": {"init_logger": logging.getLogger},
        # the switches the server tests read: none of vLLM's optional front ends here
        "vllm.envs": {"__getattr__": _env},
    }


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the stand-in modules, and placeholder modules for every other ``vllm.*``."""

    def __init__(self) -> None:
        self.modules = _modules()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for the stand-ins and the placeholder modules."""
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        """A fresh module with the stand-in's attributes."""
        module = types.ModuleType(spec.name)
        module.__dict__.update({"__getattr__": _placeholders(spec.name), **self.modules.get(spec.name, {})})
        if spec.submodule_search_locations is not None:
            module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run."""


def _patch_auto_tokenizer() -> None:
    """``transformers.AutoTokenizer.from_pretrained(<a vLLM test model's hub name>)`` gives the stand-in model's
    tokenizer, as ``vllm.tokenizers.get_tokenizer`` does: the tests compare the server's token ids with it. Local
    paths and names without a stand-in go to transformers as before (nothing is fetched: offline)."""
    import transformers

    from .translate import Refused, local_model

    original = transformers.AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        if os.path.exists(str(name)):
            return original(cls, name, *args, **kwargs)
        try:
            path, _ = local_model(str(name))
        except Refused:
            return original(cls, name, *args, **kwargs)
        from pagedllm.models.loader import load_tokenizer

        return load_tokenizer(path)

    transformers.AutoTokenizer.from_pretrained = classmethod(from_pretrained)


def install() -> None:
    """Put the stand-in ``vllm`` ahead of any other on the import path (and the stand-in's tokenizer behind
    AutoTokenizer's hub names)."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Finder())
    _patch_auto_tokenizer()
