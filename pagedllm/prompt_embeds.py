"""A prompt given as embeddings instead of token ids (vLLM's ``prompt_embeds``, with --enable-prompt-embeds).

``PromptEmbeds`` is plain data (raw bytes, shape, dtype name): it crosses every seam a prompt's token ids cross (the
front -> core message, the scheduler -> worker output) and the scheduler, which never imports torch, holds it. The
worker turns it into a tensor once (worker/input_batch.py) and feeds those rows to the model in place of the
embeddings of the prompt's placeholder ids; engine/prompt_embeds.py makes it from a client's tensor or base64
payload. This module is plain data (no torch: the scheduler holds it).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

#: The dtypes a prompt's embeddings may come in (cast to the model's dtype by the worker).
DTYPES = ("float32", "bfloat16", "float16")
#: The id each embedded position carries in the token lists (the scheduler's and the workers' bookkeeping only: the
#: model never embeds it, the prefix cache never matches it, see PromptEmbeds.digest).
PLACEHOLDER_TOKEN_ID = 0


@dataclass(frozen=True, kw_only=True)
class PromptEmbeds:
    """A prompt's embeddings, (num_tokens, hidden_size) row-major in ``dtype``, as bytes."""

    data: bytes
    num_tokens: int
    hidden_size: int
    dtype: str
    """One of DTYPES."""
    digest: str = field(default="", compare=False)
    """A hash of the embeddings (filled in when empty): the prefix cache keys this prompt's blocks by it, so two
    prompts share cached K/V only when their embeddings are the same bytes, never by their placeholder ids."""

    def __post_init__(self) -> None:
        assert self.dtype in DTYPES, self.dtype
        assert len(self.data) == self.num_tokens * self.hidden_size * self.itemsize
        if not self.digest:
            object.__setattr__(self, "digest", hashlib.blake2b(
                self.data + f"{self.num_tokens}x{self.hidden_size}:{self.dtype}".encode(), digest_size=16).hexdigest())

    @property
    def placeholder_ids(self) -> list[int]:
        """The prompt's token ids as the scheduler and workers count them: one placeholder per embedded position."""
        return [PLACEHOLDER_TOKEN_ID] * self.num_tokens

    @property
    def itemsize(self) -> int:
        """Bytes per value."""
        return 4 if self.dtype == "float32" else 2
