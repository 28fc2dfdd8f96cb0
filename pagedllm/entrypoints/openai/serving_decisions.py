"""vLLM's structured decisions on a chat model: POST /v1/decisions (OpenAI's Decisions shape) and POST /v1/systemone
(vLLM's own shape). Each question is one prompt: a user turn holding the input (the state), a blank line, the question
and one labelled line per option ("A: option"; "yes"/"no"; "0".."9" for /v1/systemone's noul and score types) and a
reply instruction, rendered through the chat template up to the assistant's turn with thinking off. The model reads
the next position once (OpenAIServingGenerativeScoring.read_labels: one greedy token, with the raw log-probabilities of
the labels' tokens); a question's answer comes from the softmax over its labels, its confidence is the top label's
share times the labels' whole-vocabulary probability (label_mass).

A label's token is the one the label adds after the chat prompt's tail (the ids after its last special token): found
once from a probe conversation; a model whose labels are not one distinct token each there answers 501, and a request
whose chat options end its prompts otherwise a 400. Every size a client controls is checked (400 naming the field)
before anything is rendered or queued."""
from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.processor import PromptType, check_template_kwargs, render_chat
from pagedllm.entrypoints.openai.limits import check_count
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.protocol_decisions import (
    ChoiceAnswer,
    ChoiceProbability,
    ChoiceQuestion,
    DecisionInputTokensDetails,
    DecisionOutputTokensDetails,
    DecisionQuestion,
    DecisionRequest,
    DecisionResponse,
    DecisionUsage,
    PredicateAnswer,
    PredicateQuestion,
    QuestionDiagnostics,
    ScoreAnswer,
    ScoreProbability,
    StructuredDecisionRequest,
    StructuredDecisionResponse,
    StructuredDecisionUsage,
)
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.entrypoints.openai.serving_generative_scoring import (
    GONE,
    OpenAIServingGenerativeScoring,
    check_cache_salt,
    check_request_fields,
    label_probabilities,
)
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput

MAX_READ_QUESTIONS = 64
"""Most questions one request may ask a chat model (one prompt each; vLLM's bound for its next-token models)."""

LETTERS = tuple(string.ascii_uppercase)
"""A choice's labels, in option order (so at most 26 options)."""
YES_NO = ("yes", "no")
"""A noul question's labels."""
DIGITS = tuple(string.digits)
"""A score question's labels: a level's label is its value (so at most 10 levels)."""
LABEL_SETS = {"choice": LETTERS, "noul": YES_NO, "score": DIGITS}
"""/v1/systemone's question types and their labels (/v1/decisions asks every question as a lettered choice)."""
REPLY_INSTRUCTIONS = {"choice": "Answer with the letter of one option only.",
                      "noul": "Answer with yes or no only.",
                      "score": "Answer with the number of one level only."}


class DecisionsUnsupportedError(Exception):
    """The served model cannot answer decisions (the route's 501): no chat template, or a label that is not one
    distinct token after its chat prompt."""


@dataclass(frozen=True)
class Option:
    name: str
    description: str | None = None


@dataclass(frozen=True)
class Question:
    """One read: its id, kind ("choice", "noul" or "score": how its options are written), instructions, options
    and their labels."""

    id: str
    kind: str
    instructions: str
    options: tuple[Option, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        return LABEL_SETS[self.kind][:len(self.options)]

    def text(self) -> str:
        """The question as the model reads it after the state: its instructions, an option per line, the reply
        instruction."""
        lines = [f"Question: {self.instructions}"] if self.instructions else []
        for label, option in zip(self.labels, self.options):
            if self.kind == "noul":  # the label alone when undescribed (so the model sees what to answer)
                lines.append(f"{label}: {option.description}" if option.description else label)
            else:
                lines.append(f"{label}: {option.name} - {option.description}" if option.description
                             else f"{label}: {option.name}")
        lines.append(REPLY_INSTRUCTIONS[self.kind])
        return "\n".join(lines)


@dataclass
class Read:
    """A question's read: its labels' probabilities (over the labels, summing to 1), the labels' whole-vocabulary
    probability, whether the greedy token was a label, and the prompt's usage."""

    probs: list[float]
    label_mass: float
    argmax_is_label: bool
    input_tokens: int
    output_tokens: int
    cached_tokens: int

    @property
    def top(self) -> int:
        return max(range(len(self.probs)), key=self.probs.__getitem__)

    @property
    def confidence(self) -> float:
        return self.probs[self.top] * self.label_mass


def _text_of(value: Any) -> str:
    """A client's value as the model reads it: a string as it is, anything else as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _limit(qid: str, kind: str, count: int) -> None:
    most = len(LABEL_SETS[kind])
    if count > most:
        raise ValidationError(f"question {qid!r} has {count} options: at most {most} options for this model "
                              f"(one label each)", param=f"questions.{qid}", value=count)


def parse_spec(qid: str, kind: str, instructions: Any, criteria: Any) -> Question:
    """A /v1/systemone question from its type name and criteria (400 naming the question when they do not fit)."""
    param = f"questions.{qid}"
    if not qid:
        raise ValidationError("question ids must not be empty", param="questions")
    if kind not in LABEL_SETS:
        raise ValidationError(f"question {qid!r} has type {kind!r}; the types are {sorted(LABEL_SETS)}", param=param)
    if kind == "choice":
        if not isinstance(criteria, dict) or not criteria:
            raise ValidationError(f"question {qid!r}: a choice's criteria must be an object of option names, each "
                                  "with a description or null", param=param)
        _limit(qid, kind, len(criteria))
        options = [Option(name, None if desc is None else _text_of(desc)) for name, desc in criteria.items()]
    elif kind == "noul":
        if criteria is not None and (not isinstance(criteria, dict) or not set(criteria) <= {"true", "false"}):
            raise ValidationError(f"question {qid!r}: a noul's criteria must be an object with at most the keys "
                                  "true and false (what each means)", param=param)
        sides = criteria or {}
        options = [Option("yes", None if sides.get("true") is None else _text_of(sides["true"])),
                   Option("no", None if sides.get("false") is None else _text_of(sides["false"]))]
    else:
        if not isinstance(criteria, list) or len(criteria) < 2:
            raise ValidationError(f"question {qid!r}: a score's criteria must be an ordered list of levels (two or "
                                  "more, lowest first)", param=param)
        _limit(qid, kind, len(criteria))
        options = [Option(_text_of(level)) for level in criteria]
    names = [o.name for o in options]
    if len(set(names)) != len(names):
        raise ValidationError(f"question {qid!r} names an option twice", param=param)
    text = "" if instructions is None else _text_of(instructions)
    return Question(qid, kind, text, tuple(options))


def decision_question(index: int, q: DecisionQuestion) -> Question:
    """A /v1/decisions question as a lettered choice: a predicate's options are false then true, a choice's its
    values as JSON, a score's its levels."""
    if isinstance(q, PredicateQuestion):
        options = [Option("false"), Option("true")]
    elif isinstance(q, ChoiceQuestion):
        options = [Option(json.dumps(c.value, ensure_ascii=False), c.description) for c in q.choices]
    else:
        options = [Option(level.label, level.description) for level in q.levels]
    if len(options) > len(LETTERS):
        raise ValidationError(f"questions[{index}] has {len(options)} options: this model labels at most "
                              f"{len(LETTERS)} choices per question (one letter each)", param=f"questions[{index}]",
                              value=len(options))
    return Question(str(index), "choice", q.instructions, tuple(options))


def input_text(value: str | list[Any]) -> str:
    """/v1/decisions' input as one text: its messages joined by blank lines, a message's parts by newlines."""
    if isinstance(value, str):
        return value
    return "\n\n".join(m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
                       for m in value)


class OpenAIServingDecisions(OpenAIServing):
    """/v1/decisions and /v1/systemone, over the generative scoring endpoint's read (its limits, admission, LoRA and
    timeouts)."""

    def __init__(self, scoring: OpenAIServingGenerativeScoring, chat_template: str | None = None) -> None:
        super().__init__(scoring.engine, scoring.models, scoring.limits, scoring.admission)
        self.scoring = scoring
        self.chat_template = chat_template
        """--chat-template (None: the model's own)."""
        self.trust_request_chat_template = False
        """--trust-request-chat-template: chat_template_kwargs may carry a template of the request's own."""
        self._labels: tuple[list[int], dict[str, int]] | str | None = None
        """(the chat prompt's tail, label -> token id) once found; the reason the model cannot serve, as a string."""

    # ------------------------------------------------------------------ the labels' tokens
    def _tail(self, prompt_ids: list[int]) -> list[int]:
        """The ids after the prompt's last added (special) token."""
        added = set(getattr(self.tokenizer, "get_added_vocab", dict)().values())
        start = max((i + 1 for i, t in enumerate(prompt_ids) if t in added), default=0)
        return prompt_ids[start:]

    def _find_labels(self) -> tuple[list[int], dict[str, int]] | str:
        """(tail, label ids) from a probe conversation, or why this model cannot answer decisions."""
        try:
            _, probe = render_chat(self.tokenizer, [{"role": "user", "content": "x"}], self.chat_template, True,
                                   template_kwargs={"enable_thinking": False})
        except ValidationError as e:
            return f"the model's chat prompt cannot be rendered ({e.message})"
        tail = self._tail(list(probe))
        text = self.tokenizer.decode(tail)
        ids: dict[str, int] = {}
        for labels in LABEL_SETS.values():
            seen: set[int] = set()
            for label in labels:
                extended = list(self.tokenizer.encode(text + label, add_special_tokens=False))
                if extended[:-1] != tail or extended[-1] in seen:
                    return f"the label {label!r} is not one distinct token after this model's chat prompt"
                seen.add(extended[-1])
                ids[label] = extended[-1]
        return tail, ids

    async def labels(self) -> tuple[list[int], dict[str, int]]:
        """The chat prompt's tail and each label's token (found once); DecisionsUnsupportedError if they cannot be."""
        if self._labels is None:
            self._labels = await self.engine.in_tokenizer_thread(self._find_labels)
        if isinstance(self._labels, str):
            raise DecisionsUnsupportedError(f"this model does not support structured decisions: {self._labels}")
        return self._labels

    # ------------------------------------------------------------------ the routes
    async def decide(self, req: DecisionRequest, raw: Request) -> Response:
        """/v1/decisions: each question's answer, in question order, and the usage (one output token each)."""
        model, lora = self.check_model(req.model)
        if len(req.questions) > MAX_READ_QUESTIONS:
            raise ValidationError(f"questions has {len(req.questions)} entries: at most {MAX_READ_QUESTIONS} for "
                                  "this model (one read each)", param="questions", value=len(req.questions))
        questions = [decision_question(i, q) for i, q in enumerate(req.questions)]
        if req.joint:
            raise ValidationError("joint: this model answers every question by its own read; joint reads are for "
                                  "vLLM's diffusion models", param="joint", value=True)
        check_cache_salt(req.cache_salt)
        reads = await self._read(questions, input_text(req.input), "input", None, {}, None, req.cache_salt, lora, raw)
        if reads is None:
            return Response(status_code=GONE)
        answers: list[PredicateAnswer | ChoiceAnswer | ScoreAnswer] = []
        for q, read in zip(req.questions, reads):
            if isinstance(q, PredicateQuestion):
                answers.append(PredicateAnswer(name=q.name, probability=read.probs[1]))
            elif isinstance(q, ChoiceQuestion):
                answers.append(ChoiceAnswer(
                    name=q.name, choice=q.choices[read.top].value, confidence=read.confidence,
                    probabilities=[ChoiceProbability(value=c.value, probability=p) for c, p in zip(q.choices,
                                                                                                  read.probs)]))
            else:
                answers.append(ScoreAnswer(
                    name=q.name, score=sum(i * p for i, p in enumerate(read.probs)), confidence=read.confidence,
                    probabilities=[ScoreProbability(value=i, label=level.label, probability=p)
                                   for i, (level, p) in enumerate(zip(q.levels, read.probs))]))
        inputs, outputs = sum(r.input_tokens for r in reads), sum(r.output_tokens for r in reads)
        usage = DecisionUsage(input_tokens=inputs, output_tokens=outputs, total_tokens=inputs + outputs,
                              input_tokens_details=DecisionInputTokensDetails(
                                  cached_tokens=sum(r.cached_tokens for r in reads)),
                              output_tokens_details=DecisionOutputTokensDetails())
        return JSONResponse(DecisionResponse(model=model, answers=answers, usage=usage).model_dump())

    async def systemone(self, req: StructuredDecisionRequest, raw: Request) -> Response:
        """/v1/systemone: answers and diagnostics by question id, in the request's order."""
        model, lora = self.check_model(req.model)
        if not req.questions:
            raise ValidationError("questions must hold at least one question", param="questions")
        if len(req.questions) > MAX_READ_QUESTIONS:
            raise ValidationError(f"questions has {len(req.questions)} entries: at most {MAX_READ_QUESTIONS} for "
                                  "this model (one read each)", param="questions", value=len(req.questions))
        questions = []
        for qid, spec in req.questions.items():
            if spec.model_extra:
                raise ValidationError(f"question {qid!r} has unknown field(s) {sorted(spec.model_extra)} (a question "
                                      "has type, instructions and criteria)", param=f"questions.{qid}")
            questions.append(parse_spec(qid, spec.type, spec.instructions, spec.criteria))
        for field in ("images", "audio", "videos"):
            if getattr(req, field):
                raise ValidationError(f"{field}: this model reads text only (no image, audio or video inputs)",
                                      param=field)
        if req.joint:
            raise ValidationError("joint: this model answers every question by its own read; joint reads are for "
                                  "vLLM's diffusion models", param="joint", value=True)
        check_request_fields(req.priority, req.cache_salt, req.request_id)
        kwargs = dict(req.chat_template_kwargs or {})
        template = kwargs.pop("chat_template", None)
        if template is not None:
            if not self.trust_request_chat_template:
                raise ValidationError("chat_template_kwargs.chat_template is refused: this server runs no template a "
                                      "client sends (start it with --trust-request-chat-template to allow them)",
                                      param="chat_template_kwargs")
            if not isinstance(template, str):
                raise ValidationError.bad_value("chat_template_kwargs.chat_template", template, "a string")
        kwargs = check_template_kwargs(kwargs)
        if kwargs.get("enable_thinking"):
            raise ValidationError("chat_template_kwargs.enable_thinking: the read is the reply's first token, so "
                                  "thinking must be off", param="chat_template_kwargs")
        state = _text_of(req.state)
        reads = await self._read(questions, state, "state", req.instructions or None, kwargs, template,
                                 req.cache_salt, lora, raw)
        if reads is None:
            return Response(status_code=GONE)
        answers = {q.id: self._answer(q, read) for q, read in zip(questions, reads)}
        diagnostics = {q.id: QuestionDiagnostics(label_mass=r.label_mass, argmax_is_label=r.argmax_is_label)
                       for q, r in zip(questions, reads)}
        usage = StructuredDecisionUsage(input_tokens=sum(r.input_tokens for r in reads),
                                        output_tokens=sum(r.output_tokens for r in reads))
        request_id = random_id("decision") if req.request_id is None else f"decision-{req.request_id}"
        body = StructuredDecisionResponse(id=request_id, model=model, answers=answers, usage=usage,
                                          diagnostics=diagnostics)
        return JSONResponse(body.model_dump())

    @staticmethod
    def _answer(q: Question, read: Read) -> dict[str, Any]:
        """A /v1/systemone answer of the question's type."""
        if q.kind == "choice":
            return {"type": "choice", "choice": q.options[read.top].name, "confidence": read.confidence,
                    "probabilities": {o.name: p for o, p in zip(q.options, read.probs)}}
        if q.kind == "noul":
            return {"type": "noul", "noul": read.probs[0], "confidence": read.confidence,
                    "probabilities": {"yes": read.probs[0], "no": read.probs[1]}}
        return {"type": "score", "score": sum(i * p for i, p in enumerate(read.probs)), "confidence": read.confidence,
                "legend": {str(i): o.name for i, o in enumerate(q.options)},
                "probabilities": {str(i): p for i, p in enumerate(read.probs)}}

    # ------------------------------------------------------------------ the read
    async def _read(self, questions: list[Question], state: str, state_param: str, system: str | None,
                    kwargs: dict[str, Any], template: str | None, cache_salt: str | None, lora: LoRARequest | None,
                    raw: Request) -> list[Read] | None:
        """Each question read after ``state`` (None: the client left): the prompts' text sizes checked, rendered
        (thinking off unless ``kwargs`` say otherwise), checked to end with the chat prompt's tail and to leave the
        one position read within max_model_len, and run."""
        check_count(questions, self.limits.max_prompts, "questions", "--max-prompts")
        self.check_prompt_size([system or "", state], state_param)
        for q in questions:
            self.check_prompt_size([system or "", state, q.text()], f"questions.{q.id}")
        tail, label_ids = await self.labels()
        self._check_waiting([{}] * len(questions))  # (a full queue sheds it before it is rendered)
        template_kwargs = {"enable_thinking": False, **kwargs}

        def render() -> list[list[int]]:
            prompts = []
            for q in questions:
                conversation = [{"role": "user", "content": f"{state}\n\n{q.text()}"}]
                if system:
                    conversation.insert(0, {"role": "system", "content": system})
                try:
                    _, ids = render_chat(self.tokenizer, conversation, template or self.chat_template, True,
                                         template_kwargs=template_kwargs)
                except ValidationError:
                    raise
                except Exception as e:  # the client's variables (or template) broke the template
                    raise ValidationError(f"the chat template failed with this request's chat_template_kwargs: "
                                          f"{type(e).__name__}: {str(e)[:300]}", param="chat_template_kwargs") from e
                prompts.append(list(ids))
            return prompts

        rendered = await self.engine.in_tokenizer_thread(render)
        prompts: list[PromptType] = []
        for q, ids in zip(questions, rendered):
            if ids[len(ids) - len(tail):] != tail:
                raise ValidationError("these chat options end the prompt otherwise than the model's chat prompt, so "
                                      "the labels' tokens are not known", param="chat_template_kwargs")
            if len(ids) >= self.max_model_len:
                raise ValidationError(f"the prompt of question {q.id!r} is {len(ids)} tokens; with the one position "
                                      f"read after it, max_model_len ({self.max_model_len}) allows at most "
                                      f"{self.max_model_len - 1}", param=state_param, value=len(ids))
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            prompts.append(prompt)
        groups = [[label_ids[label] for label in q.labels] for q in questions]
        wanted = list(dict.fromkeys(t for g in groups for t in g))
        read = await self.scoring.read_labels(random_id("decision"), prompts, wanted, lora, raw, "questions")
        if read is None:
            return None
        outputs, logprobs = read
        return [self._question_read(out, group, dict(zip(wanted, lps)))
                for out, group, lps in zip(outputs, groups, logprobs)]

    @staticmethod
    def _question_read(out: RequestOutput, group: list[int], logprobs: dict[int, float]) -> Read:
        lps = [logprobs[t] for t in group]
        tokens = out.outputs[0].token_ids if out.outputs else []
        return Read(probs=label_probabilities(lps, True), label_mass=sum(math.exp(lp) for lp in lps),
                    argmax_is_label=bool(tokens) and tokens[0] in group, input_tokens=len(out.prompt_token_ids),
                    output_tokens=len(tokens), cached_tokens=max(out.num_cached_tokens, 0))
