"""No engine core at all: what a render-only server (`pagedllm launch render`, vLLM's `vllm launch render`) needs of
one, read from the model's files: its resolved configuration, tokenizer, vocabulary and end tokens. No weights are
loaded and no KV cache is sized, so it starts in seconds on any machine and serves the preprocessing and
postprocessing routes (render, derender, tokenize) of a disaggregated deployment whose generate servers run
elsewhere. Nothing is ever sent to a core: such a server has no route that sends, and a message is an error.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import CORE_EXIT_TIMEOUT_S, AsyncCoreClient, EngineDeadError
from pagedllm.engine.messages import PROTOCOL_VERSION, CoreMessage, CoreReady, EngineStats, FrontMessage


class RenderOnlyClient(AsyncCoreClient):
    """An AsyncCoreClient with no core behind it (AsyncLLM over it tokenizes and renders; it generates nothing)."""

    def __init__(self, args: EngineArgs) -> None:
        from pagedllm.models.loader import load_eos_token_ids, load_tokenizer

        config, arch = args.create_engine_config()
        self.tokenizer = load_tokenizer(config.model.model)
        eos = load_eos_token_ids(config.model.model, arch, self.tokenizer)
        self.ready = CoreReady(version=PROTOCOL_VERSION, config=config, vocab_size=arch.vocab_size,
                               eos_token_ids=list(eos), num_kv_blocks=0,
                               stats=EngineStats(block_size=config.cache.block_size), hidden_size=arch.embeds_width)
        self._started = self._closed = False

    def start(self, on_message: Callable[[CoreMessage], None],
              on_dead: Callable[[EngineDeadError], None]) -> None:
        self._started = True

    def send(self, message: FrontMessage) -> None:
        raise EngineDeadError("this is a render-only server (pagedllm launch render): it runs no engine, so it "
                              "renders and derenders requests but generates nothing")

    def call_now(self, method: str, args: list[Any]) -> Any:
        raise EngineDeadError(f"a render-only server runs no engine ({method} needs one)")

    def is_alive(self) -> bool:
        return self._started and not self._closed

    def close(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        self._closed = True
