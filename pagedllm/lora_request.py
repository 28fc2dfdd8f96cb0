"""LoRARequest: which adapter a request runs with (plain data, vLLM's fields)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import ValidationError

ADAPTER_CONFIG_FILE = "adapter_config.json"
"""A PEFT adapter folder's config: a folder without one holds no adapter (the server's 404)."""


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter in PEFT format (adapter_config.json + adapter_model.safetensors) by name, id and path.

    ``lora_int_id`` identifies the adapter inside the engine (its slot, its prefix-cache entries):
    two requests with the same id must name the same adapter.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValidationError.bad_value("lora_request.lora_name", self.lora_name, "a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValidationError.bad_value("lora_request.lora_int_id", self.lora_int_id, "an integer >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValidationError.bad_value("lora_request.lora_path", self.lora_path,
                                            "the folder of a PEFT adapter")

    @property
    def adapter_id(self) -> int:
        """vLLM's other name for lora_int_id."""
        return self.lora_int_id
