"""SamplingParams: how to pick tokens and when to stop, with vLLM's names and defaults."""
from __future__ import annotations

import enum
import json as _json
from array import array
from dataclasses import dataclass, replace

from pagedllm.errors import ValidationError

#: Temperatures below this are greedy (as in vLLM).
SAMPLING_EPS = 1e-5
#: A request's seed range: a signed 64-bit integer (vLLM's bound; torch generators take it).
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
#: |length_penalty| bound: generated_length ** length_penalty stays a finite, non-zero float for any
#: length up to 2 ** 20 tokens (2 ** (20 * 40) < 1.8e308, the float range).
MAX_LENGTH_PENALTY = 40.0
#: Most logprob_token_ids of one request (vLLM's bound).
MAX_LOGPROB_TOKEN_IDS = 128


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0
    """Everything generated so far, every step."""
    DELTA = 1
    """Only what is new since the previous output (streaming); text holds back a possible stop string."""
    FINAL_ONLY = 2
    """One output, when the request finishes (offline generation)."""


def check_refs(schema: str | dict, param: str = "structured_outputs.json") -> None:
    """ValidationError when a ``$ref`` of a JSON schema points anywhere but into the schema itself ("#..."):
    xgrammar fetches nothing, so such a reference would go unenforced."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except (ValueError, RecursionError):
            return  # not JSON: the compiler's own error names it
    stack = [schema]
    while stack:  # iterative: as deep as the schema nests
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if "$ref" in item and not (isinstance(ref, str) and ref.startswith("#")):
                raise ValidationError(f"{param}: $ref {str(ref)[:200]!r} points outside the schema; only references "
                                      "into the schema itself (\"#/$defs/...\") are followed", param=param,
                                      value=str(ref)[:200])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


@dataclass
class StructuredOutputsParams:
    """One constraint on the generated text (vLLM's names): exactly one of the fields."""

    json: str | dict | None = None
    """A JSON schema (object or its text): the output is JSON that validates against it."""
    regex: str | None = None
    """The output matches this regular expression."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's GBNF dialect) the output follows."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's response_format json_object)."""

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValidationError("structured_outputs takes exactly one of json, regex, choice, grammar, "
                                  f"json_object; got {given or 'none'}", param="structured_outputs", value=given)
        bad = ValidationError.bad_value
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise bad("structured_outputs.json", self.json, "a JSON schema (an object or its text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(f"structured_outputs.{name}", value, "a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise bad("structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n))


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (field names and defaults as vLLM's)."""

    n: int = 1
    """Number of output sequences to return for the prompt."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that already appeared in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it appeared in the output."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens seen in prompt or output."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's."""
    seed: int | None = None
    """Per-request random seed: the same output whatever else is in the batch."""
    stop: str | list[str] | None = None
    """Strings that end generation; not included in the text unless asked."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (kept in token_ids)."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to max_model_len."""
    min_tokens: int = 0
    """Generate at least this many tokens before EOS / stop_token_ids / stop strings count."""
    logprobs: int | None = None
    """Return this many top log-probabilities per generated token (plus the sampled one); -1: every token of the
    vocabulary (vLLM's). At most the engine's max_logprobs."""
    prompt_logprobs: int | None = None
    """Return this many top log-probabilities per prompt token (plus the prompt token's own; -1: every token of
    the vocabulary, at most the engine's max_logprobs); a request asking for them computes its whole prompt (no
    prefix-cache hit)."""
    prompt_logprob_token_ids: list[list[int]] | None = None
    """vLLM's: per scored prompt row (row i predicts prompt token ``prompt_logprob_start + i + 1``), the token ids
    whose log-probabilities it returns (``RequestOutput.prompt_token_id_logprobs``, shaped [rows, ids]; -1 pads a
    row and scores -inf); exactly as many rows as the prompt has scored rows, at most max_logprobs ids a row. Like
    prompt_logprobs, the whole prompt is computed (no prefix-cache hit)."""
    prompt_logprob_start: int | None = None
    """vLLM's: the first prompt row scored by prompt_logprobs and prompt_logprob_token_ids (the prompt tokens
    before row start + 1 get None); needs one of them."""
    logprob_token_ids: list[int] | None = None
    """vLLM's: the log-probabilities of exactly these tokens (and the sampled one) at each generated position,
    instead of the top ``logprobs`` (which becomes their count); at most MAX_LOGPROB_TOKEN_IDS."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """Cumulative, delta (streaming) or final-only outputs."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling (OpenAI's range [-100, 100])."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled."""
    bad_words: list[str] | None = None
    """Words never generated: the last token of a word is banned where the tokens before it were
    just generated (each word tokenized with and without a leading space)."""
    bad_words_token_ids: list[list[int]] | None = None
    """The tokenized bad_words (set by the engine's processor from the model's tokenizer)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice or a grammar."""
    speculate: bool = True
    """With an engine's speculative_config: False opts this request out (it decodes one token per step)."""
    watermarking: bool = True
    """With an engine's watermark_config: False opts this request out (its tokens are sampled as usual), unless
    the config enforces the watermark."""
    thinking_token_budget: int | None = None
    """Most tokens generated inside a reasoning section (after the last reasoning_start_token_ids not yet
    closed); once spent, reasoning_end_token_ids are forced, one per step (vLLM's name; None or -1: no cap)."""
    reasoning_start_token_ids: list[int] | None = None
    """The tokens that open a reasoning section (the server sets them from its --reasoning-parser)."""
    reasoning_end_token_ids: list[int] | None = None
    """The tokens that close it, forced when thinking_token_budget is spent."""
    reasoning_forced_end_token_ids: list[int] | None = None
    """What a spent thinking_token_budget forces instead, when it is not reasoning_end_token_ids (vLLM's
    --reasoning-config reasoning_end_str: a phrase that leads up to the end marker); the section is closed once
    these or reasoning_end_token_ids are written. None: reasoning_end_token_ids."""
    stream_interval: int = 1
    """Streamed (DELTA) outputs: a choice's news is handed out once this many new tokens gathered (its first
    token and its end at once), as vLLM's stream_interval; fewer, larger chunks for a client that pays per chunk."""
    grammar_after_reasoning: bool = False
    """The reply starts inside a reasoning section, and structured_outputs holds only after it ends (as vLLM's
    structured outputs with a reasoning parser): until the output holds reasoning_end_token_ids (or
    reasoning_forced_end_token_ids), or one of reasoning_implicit_end_token_ids, the grammar neither masks nor reads
    a token; it then reads the tokens after the end marker (from the implicit end token on). The server sets it
    with --reasoning-parser where the request's thinking is on."""
    reasoning_implicit_end_token_ids: list[int] | None = None
    """Tokens that end the reasoning and are the content's first (qwen3's ``<tool_call>``), for
    grammar_after_reasoning: one the grammar cannot start with is never sampled while the reasoning lasts, as vLLM."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValidationError.bad_value("stop", self.stop, "a string or a list of strings")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValidationError.bad_value("stop_token_ids", self.stop_token_ids, "a list of token ids")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify_types()
        self._verify_ranges()

    def _verify_types(self) -> None:
        bad = ValidationError.bad_value
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, value, "a number")
        for name in ("n", "top_k", "min_tokens", "stream_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, value, "an integer")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed", "prompt_logprob_start"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise bad(name, value, "an integer or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculate", "watermarking"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "true or false")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "a mapping of token id to bias")
            try:  # OpenAI sends the ids as JSON object keys: strings
                self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise bad("logit_bias", self.logit_bias, "a mapping of integer token ids to numbers") from None
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
        if self.thinking_token_budget == -1 and not isinstance(self.thinking_token_budget, bool):
            self.thinking_token_budget = None  # vLLM's "unlimited"
        if self.thinking_token_budget is not None:
            self._verify_thinking_budget()
        if not isinstance(self.grammar_after_reasoning, bool):
            raise bad("grammar_after_reasoning", self.grammar_after_reasoning, "true or false")
        if self.grammar_after_reasoning and self.structured_outputs is not None:
            self._verify_grammar_after_reasoning()
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if (not isinstance(ids, (list, tuple)) or not 0 < len(ids) <= MAX_LOGPROB_TOKEN_IDS
                    or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
                raise bad("logprob_token_ids", ids, f"a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids")
            self.logprob_token_ids = list(dict.fromkeys(ids))  # (a repeated id is listed once)
            self.logprobs = len(self.logprob_token_ids)  # the ids take the place of the top-N
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", self.bad_words, "a list of non-empty strings")

    def _verify_thinking_budget(self) -> None:
        budget = self.thinking_token_budget
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValidationError.bad_value("thinking_token_budget", budget, "an integer >= 0, or -1 for no cap")
        for name in ("reasoning_start_token_ids", "reasoning_end_token_ids"):
            ids = getattr(self, name)
            if not ids:
                raise ValidationError("thinking_token_budget needs the tokens that open and close reasoning (a "
                                      "server started with --reasoning-parser knows them; offline: set "
                                      "reasoning_start_token_ids and reasoning_end_token_ids)",
                                      param="thinking_token_budget", value=budget)
            if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                         for t in ids):
                raise ValidationError.bad_value(name, ids, "a non-empty list of token ids")
        forced = self.reasoning_forced_end_token_ids
        if forced is not None and (not isinstance(forced, (list, tuple)) or not forced or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in forced)):
            raise ValidationError.bad_value("reasoning_forced_end_token_ids", forced, "a non-empty list of token ids")

    def _verify_grammar_after_reasoning(self) -> None:
        for name in ("reasoning_end_token_ids", "reasoning_forced_end_token_ids", "reasoning_implicit_end_token_ids"):
            ids = getattr(self, name)
            if ids is None and name != "reasoning_end_token_ids":
                continue
            if not isinstance(ids, (list, tuple)) or not ids or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise ValidationError(f"grammar_after_reasoning needs {name} as a non-empty list of token ids (the "
                                      "tokens that end the reasoning; a server started with --reasoning-parser "
                                      "knows them)", param=name, value=ids)

    def _verify_ranges(self) -> None:
        bad = ValidationError.bad_value
        if self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.stream_interval < 1:
            raise bad("stream_interval", self.stream_interval, "an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, value, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < -1:
                raise bad(name, getattr(self, name), "an integer >= 0, or -1 for the whole vocabulary")
        self._verify_prompt_scoring()
        if self.logit_bias and any(not -100.0 <= b <= 100.0 or t < 0 for t, b in self.logit_bias.items()):
            raise bad("logit_bias", self.logit_bias, "non-negative token ids with biases in [-100, 100]")
        # sample i of n runs with seed + i: every one of them must fit a 64-bit generator seed (the words name the
        # bound broken as pydantic's error types do, greater_than_equal / less_than_equal: vLLM's clients match them)
        if self.seed is not None and self.seed < SEED_MIN:
            raise bad("seed", self.seed, f">= {SEED_MIN} (greater_than_equal: a signed 64-bit integer)")
        if self.seed is not None and self.seed > SEED_MAX - (self.n - 1):
            raise bad("seed", self.seed, f"<= {SEED_MAX - (self.n - 1)} (less_than_equal: with n={self.n}, samples use "
                      "seed, seed + 1, ... seed + n - 1: each a signed 64-bit integer)")

    def _verify_prompt_scoring(self) -> None:
        """prompt_logprob_token_ids' shape and values (its bounds against the model: engine/processor.py, before it
        is padded) and prompt_logprob_start's."""
        rows, name = self.prompt_logprob_token_ids, "prompt_logprob_token_ids"
        if getattr(rows, "ndim", None) == 2 and getattr(getattr(rows, "dtype", None), "kind", None) in ("i", "u"):
            rows = self.prompt_logprob_token_ids = rows.tolist()  # a numpy integer array, as vLLM takes one
        if rows is not None:
            if not isinstance(rows, list) or not rows or any(not isinstance(r, list) for r in rows) \
                    or not any(rows):
                raise ValidationError("prompt_logprob_token_ids must be a non-empty integer array of shape "
                                      "[num_rows, num_ids]", param=name)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < -1 for r in rows for t in r):
                raise ValidationError("prompt_logprob_token_ids must contain token ids (-1 pads a row)", param=name)
        start = self.prompt_logprob_start
        if start is not None and rows is None and self.prompt_logprobs is None:
            raise ValidationError("prompt_logprob_start requires prompt_logprobs or prompt_logprob_token_ids",
                                  param="prompt_logprob_start", value=start)
        if start is not None and start < 0:
            raise ValidationError.bad_value("prompt_logprob_start", start, "an integer >= 0")

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's rows are scored (prompt_logprobs or prompt_logprob_token_ids): every row computed."""
        return self.prompt_logprobs is not None or self.prompt_logprob_token_ids is not None

    @property
    def greedy(self) -> bool:
        """True when the sampled token is the argmax."""
        return self.temperature < SAMPLING_EPS

    def child(self, index: int) -> SamplingParams:
        """Parameters of sample ``index`` of an n>1 request: one sequence, seed offset by index."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's names): keep the ``beam_width`` best sequences at every step."""

    beam_width: int
    """Beams kept at every step, and sequences returned."""
    max_tokens: int
    """Most tokens generated per beam."""
    ignore_eos: bool = False
    """Keep beams going after EOS (only max_tokens ends them)."""
    temperature: float = 0.0
    """Only 0 (deterministic beam search) is supported."""
    length_penalty: float = 1.0
    """A finished beam scores cum_logprob / generated_length ** length_penalty."""

    def __post_init__(self) -> None:
        bad = ValidationError.bad_value
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise bad("beam_width", self.beam_width, "an integer >= 1")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if self.temperature != 0.0:
            raise bad("temperature", self.temperature, "0 (sampling beam search is not supported)")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise bad("length_penalty", self.length_penalty, "a number")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:  # NaN fails too
            raise bad("length_penalty", self.length_penalty, f"a finite number in [-{MAX_LENGTH_PENALTY:g}, "
                      f"{MAX_LENGTH_PENALTY:g}]")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "true or false")


def last_index(tokens: list[int], marker: list[int]) -> int:
    """Where the last occurrence of ``marker`` begins in ``tokens`` (-1: nowhere). Searched as 8-byte words with
    bytes.rfind: it runs at every step for each row with a thinking budget, over the whole prompt until a marker
    is found, so the scan is in C (a match must start on a word boundary)."""
    hay, needle = array("q", tokens).tobytes(), array("q", marker).tobytes()
    end = len(hay)
    while (at := hay.rfind(needle, 0, end)) >= 0:
        if at % 8 == 0:
            return at // 8
        end = at + len(needle) - 1  # a match across word boundaries: look further left
    return -1


def _forced_written(tokens: list[int], opened: int, forced: list[int]) -> int:
    """How much of ``forced`` the tokens after position ``opened`` end with (a forced end in progress)."""
    for k in range(min(len(forced) - 1, len(tokens) - opened), 0, -1):
        if tokens[len(tokens) - k:] == forced[:k]:
            return k
    return 0


def thinking_budget_forced_token(tokens: list[int], start: list[int], end: list[int], budget: int,
                                 forced: list[int] | None = None) -> int | None:
    """The token a thinking_token_budget forces after ``tokens`` (prompt + output), or None: inside a reasoning
    section (its last ``start`` not followed by ``end`` or ``forced``) that already holds ``budget`` tokens, the
    next token of ``forced`` (default ``end``): its first, or the one after the part of it the tokens already end
    with. (The forced tokens count toward the section, as vLLM counts them.)"""
    forced = forced or end
    last_start = last_index(tokens, start)
    if last_start < 0:
        return None
    opened = last_start + len(start)
    if last_index(tokens[opened:], end) >= 0 or (forced is not end and last_index(tokens[opened:], forced) >= 0):
        return None  # closed (by the model, or by the budget)
    written = _forced_written(tokens, opened, forced)
    if len(tokens) - opened - written < budget:
        return None
    return forced[written]


def reasoning_token_count(prompt: list[int], output: list[int], start: list[int], end: list[int],
                          inside: bool = False) -> int:
    """How many of ``output``'s tokens lie inside reasoning sections (``start`` ... ``end``, the markers not
    counted); a prompt that ends inside one (a template that opens the thinking), or ``inside`` (a parser that
    reads the reply as starting in its reasoning), starts the output inside it."""
    if not start or not end:
        return 0
    opened = last_index(prompt, start)
    inside = inside or (opened >= 0 and last_index(prompt[opened:], end) < 0)
    count, i = 0, 0
    while i < len(output):
        for marker, state in ((start, True), (end, False)):
            if output[i:i + len(marker)] == marker:
                inside, i = state, i + len(marker)
                break
        else:
            count += inside
            i += 1
    return count
