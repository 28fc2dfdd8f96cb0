"""``from pagedllm.lora.request import LoRARequest``, as vLLM users write it (the class is plain data: L0)."""
from pagedllm.lora_request import LoRARequest

__all__ = ["LoRARequest"]
