"""Incremental detokenization and stop strings, one sequence at a time.

Text grows only once the newest tokens decode to complete characters: a token that ends in
the middle of a multi-byte character (decoded as U+FFFD) waits for the next one.
"""
from __future__ import annotations

import functools
from typing import Any

from pagedllm.sampling_params import SamplingParams

#: Prompt tokens decoded together with the first output tokens, so the first piece of text gets
#: its leading space / byte context right.
PROMPT_CONTEXT_TOKENS = 5


@functools.lru_cache(maxsize=8)
def _special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids skip_special_tokens leaves out: the named special tokens and every added token marked special
    (SmolLM2's <file_sep>, <repo_name> ... are not in all_special_ids, yet decode to nothing)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


class IncrementalDetokenizer:
    """Appends tokens, returns text deltas, and finds stop strings (also across tokens)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.num_output_tokens = 0
        self.output_text = ""
        self._stop_check_offset = 0
        # with skip_special_tokens, special tokens decode to nothing wherever they are: they never
        # enter the decode window (a run of them, e.g. EOS repeated under ignore_eos, would grow it
        # without bound and make every step decode the whole run again)
        self._invisible = _special_ids(tokenizer) if params.skip_special_tokens else frozenset()

    def carried(self) -> tuple[list[int], int, int, int]:
        """What a client carries between the calls of a streamed derender (entrypoints/openai/derender_stream.py):
        (the decode window, the tokens' read offset in it, the output tokens so far, where the stop string search
        resumes); with ``output_text``, ``resume`` rebuilds this detokenizer from it."""
        window = self._ids[self._prefix_offset:]
        return window, self._read_offset - self._prefix_offset, self.num_output_tokens, self._stop_check_offset

    def resume(self, window: list[int], read_offset: int, num_output_tokens: int, text: str,
               stop_check_offset: int) -> None:
        """Carry on from ``carried()``'s figures and the text so far (checked by the caller: offsets within
        the window and the text)."""
        self._ids, self._prefix_offset, self._read_offset = list(window), 0, read_offset
        self.num_output_tokens, self.output_text, self._stop_check_offset = num_output_tokens, text, stop_check_offset

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], stopped_by_token: bool) -> str | None:
        """Add tokens; returns the stop string that ended the text, if one did.

        ``stopped_by_token``: the last token is an EOS / stop token id; as in vLLM its text is
        shown only with include_stop_str_in_output.
        """
        for i, token_id in enumerate(new_token_ids):
            if stopped_by_token and i == len(new_token_ids) - 1 and not self.include_stop:
                self.num_output_tokens += 1
                break
            self.num_output_tokens += 1
            if token_id not in self._invisible:
                self._add_text(token_id)
            if self.num_output_tokens <= self.min_tokens:
                self._stop_check_offset = len(self.output_text)  # stop strings count only after min_tokens
            elif self.stop and (stop := self._find_stop()) is not None:
                return stop
        return None

    def _add_text(self, token_id: int) -> None:
        """A visible token's text, added once it decodes to whole characters (a byte-level piece of a character
        waits for the rest)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self.output_text += text[len(prefix_text):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _find_stop(self) -> str | None:
        """Search the text added since the last check; cut it at the earliest stop string found."""
        longest = max(len(s) for s in self.stop)
        start = max(self._stop_check_offset - longest + 1, 0)
        found = [(self.output_text.find(s, start), s) for s in self.stop]
        found = [(i, s) for i, s in found if i >= 0]
        self._stop_check_offset = len(self.output_text)
        if not found:
            return None
        index, stop = min(found)
        self.output_text = self.output_text[: index + len(stop) if self.include_stop else index]
        return stop

    def text_for_stream(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back a tail that may begin a stop string."""
        if finished or not self.stop or self.include_stop:
            return self.output_text
        hold = max(len(s) for s in self.stop) - 1
        return self.output_text[: max(len(self.output_text) - hold, 0)]
