"""A sentence-transformers folder read as it is: ``modules.json`` (Transformer, Pooling, Normalize), the Pooling
module's config and ``sentence_bert_config.json``'s ``max_seq_length``.

Modules we cannot run the way sentence-transformers does (a Dense projection, weighted-mean pooling, several
pooling modes at once) are refused with an error naming them: an embedding that silently differs from the
model's would be worse than none.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import ValidationError
from pagedllm.models.loader.hf_loader import merge_hf_overrides

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
# Pooling config key -> our pooling type
_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_max_tokens": "MAX",
          "pooling_mode_lasttoken": "LAST"}
_UNSUPPORTED_MODES = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """What a sentence-transformers folder says about pooling its model's hidden states."""

    pooling_type: str
    """"CLS", "MEAN", "MAX" or "LAST"."""
    normalize: bool
    """A Normalize module follows the pooling: embeddings have unit length."""
    max_seq_length: int | None
    """Longest input the model was trained for (sentence-transformers cuts longer ones)."""


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_sentence_transformers_config(folder: str) -> SentenceTransformersConfig | None:
    """The folder's sentence-transformers config, or None when it is not a sentence-transformers folder."""
    modules_path = os.path.join(folder, "modules.json") if os.path.isdir(folder) else ""
    if not modules_path or not os.path.isfile(modules_path):
        return None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ValidationError.bad_value("model", folder, "a folder whose modules.json is a list of modules")
    types = [m.get("type") for m in modules]
    pooling_type, normalize = "CLS", False
    for module in modules:
        kind = module.get("type")
        if kind == _TRANSFORMER:
            if module.get("path") not in ("", None, "."):
                raise ValidationError(f"the Transformer module of {folder} is in its subfolder "
                                      f"{module['path']!r}: only a model at the folder's top is read",
                                      param="model", value=folder)
        elif kind == _POOLING:
            pooling_type = _pooling_type(os.path.join(folder, module.get("path", ""), "config.json"), folder)
        elif kind == _NORMALIZE:
            normalize = True
        else:
            raise ValidationError(f"the sentence-transformers module {kind!r} of {folder} is not supported "
                                  f"(supported: Transformer, Pooling, Normalize; the folder has {types})",
                                  param="model", value=folder)
    if _POOLING not in types:
        raise ValidationError(f"{folder} has no Pooling module in modules.json", param="model", value=folder)
    max_len = None
    bert_config = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(bert_config):
        max_len = _read_json(bert_config).get("max_seq_length")
    return SentenceTransformersConfig(pooling_type=pooling_type, normalize=normalize,
                                      max_seq_length=max_len if isinstance(max_len, int) and max_len > 0 else None)


def _pooling_type(path: str, folder: str) -> str:
    """The one pooling mode a Pooling module's config turns on."""
    config = _read_json(path) if os.path.isfile(path) else {}
    unsupported = [k for k in _UNSUPPORTED_MODES if config.get(k)]
    modes = [mode for key, mode in _MODES.items() if config.get(key)]
    if unsupported or len(modes) != 1:
        raise ValidationError(f"the Pooling module of {folder} turns on {unsupported + modes or 'no mode'}: "
                              f"exactly one of {sorted(_MODES)} is supported", param="model", value=folder)
    return modes[0]


def read_task_prompts(folder: str, hf_overrides: dict[str, Any] | None = None) -> dict[str, str]:
    """The prefixes a model puts before its input per task (Cohere's ``input_type``, e.g. {"query": "query: "}):
    ``config_sentence_transformers.json``'s ``prompts``, else config.json's ``task_instructions`` (vLLM reads
    both; ``hf_overrides`` merged into config.json first); empty when the folder has neither (or is not a
    folder)."""
    for name, key in (("config_sentence_transformers.json", "prompts"), ("config.json", "task_instructions")):
        path = os.path.join(folder, name) if os.path.isdir(folder) else ""
        if not path or not os.path.isfile(path):
            continue
        found = _read_json(path)
        if name == "config.json" and hf_overrides and isinstance(found, dict):
            merge_hf_overrides(found, hf_overrides)
        prompts = found.get(key) if isinstance(found, dict) else None
        if isinstance(prompts, dict):
            kept = {k: v for k, v in prompts.items() if isinstance(k, str) and isinstance(v, str)}
            if kept:
                return kept
    return {}
