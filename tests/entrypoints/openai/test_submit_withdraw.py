"""A many-prompt request whose client leaves while some prompts are accepted and others still tokenize: every
accepted one is withdrawn (aborted), not left running to its end."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from pagedllm.entrypoints.openai.serving import OpenAIServing


class _Stream:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Engine:
    """Prompts 0-2 are accepted at once; 3-5 are still tokenizing when the client leaves."""

    tokenizer = None
    config = SimpleNamespace(model=SimpleNamespace(max_model_len=64), scheduler=SimpleNamespace(max_num_seqs=8))

    def __init__(self) -> None:
        self.accepted: list[_Stream] = []
        self.gate = asyncio.Event()

    async def add_request(self, request_id: str, prompt: Any, params: Any, lora_request: Any = None) -> _Stream:
        if int(request_id.rsplit("-", 1)[1]) >= 3:
            await self.gate.wait()  # never set: still tokenizing
        stream = _Stream()
        self.accepted.append(stream)
        return stream


def test_a_client_leaving_mid_submit_withdraws_the_accepted_prompts() -> None:
    async def run() -> list[_Stream]:
        engine = _Engine()
        serving = OpenAIServing(engine, models=None)  # type: ignore[arg-type]
        work = asyncio.ensure_future(serving._submit("cmpl-x", [f"p{i}" for i in range(6)], None, None))
        while len(engine.accepted) < 3:
            await asyncio.sleep(0)
        work.cancel()  # the client left (unless_disconnected cancels the submission)
        await asyncio.gather(work, return_exceptions=True)
        return engine.accepted

    accepted = asyncio.run(run())
    assert len(accepted) == 3 and all(s.aborted for s in accepted)
