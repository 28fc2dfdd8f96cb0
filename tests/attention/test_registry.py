"""The attention backend registry: every backend answers whether it runs here without being
imported, stands on its own (no backend inherits another's K/V writes or layout), and a new one
is a file plus a registry line."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm.attention import base
from pagedllm.attention.base import (
    AttentionBackend,
    AttentionMetadataBuilder,
    StepInputs,
    backend_class,
    get_attention_backend,
    register_backend,
    registered_backends,
    resolve_backend_name,
)
from pagedllm.errors import ValidationError


def test_every_backend_is_registered_with_its_own_is_available() -> None:
    for name, entry in registered_backends().items():
        assert callable(entry.is_available), name
        assert isinstance(entry.is_available(), bool), name
        cls = backend_class(name)
        assert cls.is_available is entry.is_available, f"{name}: the registry asks another function than the class"
        assert cls.name == name and issubclass(cls.builder_cls, AttentionMetadataBuilder)


def test_registering_without_is_available_fails() -> None:
    with pytest.raises(TypeError):
        register_backend("broken", "tests.attention.test_registry:EchoBackend")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="is_available"):
        register_backend("broken", "tests.attention.test_registry:EchoBackend", None)  # type: ignore[arg-type]
    assert "broken" not in registered_backends()


def test_backends_do_not_inherit_each_other() -> None:
    classes = [backend_class(name) for name in registered_backends()]
    for cls in classes:
        assert [c for c in cls.__mro__[1:] if c in classes] == [], f"{cls.__name__} inherits another backend"


class EchoMetadata:
    def __init__(self, rows: int) -> None:
        self.rows = rows


class EchoBuilder(AttentionMetadataBuilder):
    def order(self, num_scheduled: dict[str, int]) -> list[str]:
        return sorted(num_scheduled, reverse=True)

    def build(self, step: StepInputs) -> EchoMetadata:
        return EchoMetadata(int(step.query_start_loc[-1]))


def _never() -> bool:
    return False


class EchoBackend(AttentionBackend):
    """A backend in one place (metadata, builder, backend) for the registry test: returns q."""

    name = "echo"
    builder_cls = EchoBuilder
    is_available = staticmethod(_never)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                scale: float) -> torch.Tensor:
        assert metadata.rows == q.shape[0]
        return q


def test_a_new_backend_is_one_class_and_a_registry_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_BACKENDS", dict(base._BACKENDS))  # the registry as it was after the test
    register_backend("echo", "tests.attention.test_registry:EchoBackend", _never)
    with pytest.raises(ValidationError, match="not available"):
        resolve_backend_name("echo")
    assert resolve_backend_name("auto") != "echo"
    backend = get_attention_backend("echo")
    builder = backend.make_builder()
    assert builder.order({"a": 1, "c": 5, "b": 1}) == ["c", "b", "a"]
    step = StepInputs(req_ids=["a"], input_ids=torch.zeros(3, dtype=torch.int64), positions=torch.arange(3),
                      query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                      seq_lens=torch.tensor([3], dtype=torch.int32),
                      block_tables=torch.ones(1, 1, dtype=torch.int32), slot_mapping=torch.arange(16, 19),
                      block_size=16, sample_rows=[0], logits_indices=torch.tensor([2]))
    q = torch.randn(3, 2, 8)
    assert backend.forward(q, q, q, torch.empty(0), builder.build(step), 1.0) is q
