"""Request and response models of vLLM's two structured decision routes: the OpenAI-shaped Decisions API
(POST /v1/decisions: typed questions in a list, answers in that order) and vLLM's structured decisions API
(POST /v1/systemone: questions keyed by id, each a type name and its criteria, answers and per-question diagnostics
by id). Both are read by serving_decisions.py."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from pagedllm.entrypoints.openai.protocol import OpenAIModel
from pagedllm.errors import ValidationError

MAX_SHORT_CHARS = 1 << 20
"""Most characters of a question's instructions, name, a choice's value or description, a level's label (vLLM's)."""
MAX_INPUT_CHARS = 10 << 20
"""Most characters of the input text, or of one input message part (vLLM's)."""
MAX_INPUT_MESSAGES = 131072
"""Most input messages (vLLM's bound)."""
MAX_INPUT_PARTS = 16384
"""Most content parts of one input message (vLLM's bound)."""
MAX_QUESTIONS = 200
"""Most questions a Decisions request may list (vLLM's; a chat model answers at most MAX_READ_QUESTIONS)."""
MAX_CHOICES = 255
"""Most choices of a choice question in the request model (vLLM's; a chat model labels at most 26)."""
MAX_LEVELS = 10
"""Most levels of a score question (the ten digits label them)."""

ShortText = Annotated[StrictStr, Field(max_length=MAX_SHORT_CHARS)]
InputText = Annotated[StrictStr, Field(max_length=MAX_INPUT_CHARS)]


class DecisionInputText(OpenAIModel):
    type: Literal["input_text"]
    text: InputText


class DecisionInputMessage(OpenAIModel):
    """A user message of the input: its text, or its text parts (joined by newlines)."""

    role: Literal["user"]
    content: InputText | Annotated[list[DecisionInputText], Field(max_length=MAX_INPUT_PARTS)]
    type: Literal["message"] = "message"


class _Question(OpenAIModel):
    instructions: ShortText
    """What is asked about the input."""
    name: ShortText | None = None
    """Echoed in the question's answer (null when left out; an explicit null is refused, as vLLM)."""

    @model_validator(mode="after")
    def _named(self) -> _Question:
        if "name" in self.model_fields_set and self.name is None:
            raise ValidationError("a question's name, when given, must be a string", param="questions.name")
        return self


class PredicateQuestion(_Question):
    """True or false: the answer is the probability of true."""

    type: Literal["predicate"]


class ChoiceOption(OpenAIModel):
    value: ShortText | StrictBool
    description: ShortText = ""


class ChoiceQuestion(_Question):
    """One of 2 to MAX_CHOICES distinct values."""

    type: Literal["choice"]
    choices: list[ChoiceOption] = Field(min_length=2, max_length=MAX_CHOICES)

    @model_validator(mode="after")
    def _distinct(self) -> ChoiceQuestion:
        keys = [(type(c.value), c.value) for c in self.choices]
        if len(set(keys)) != len(keys):
            raise ValidationError("a choice question's values must all differ", param="questions.choices")
        return self


class ScoreLevel(OpenAIModel):
    label: ShortText
    description: ShortText = ""


class ScoreQuestion(_Question):
    """An ordered scale of 2 to MAX_LEVELS levels, valued 0, 1, ... in order: the answer is the expected value."""

    type: Literal["score"]
    levels: list[ScoreLevel] = Field(min_length=2, max_length=MAX_LEVELS)


DecisionQuestion = Annotated[PredicateQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class DecisionRequest(OpenAIModel):
    """POST /v1/decisions (an unknown field is a 400 naming it)."""

    model: ShortText
    input: InputText | Annotated[list[DecisionInputMessage], Field(max_length=MAX_INPUT_MESSAGES)]
    """The text the questions are about: a string, or user messages (joined by blank lines)."""
    questions: list[DecisionQuestion] = Field(min_length=1, max_length=MAX_QUESTIONS)
    safety_identifier: Annotated[StrictStr, Field(max_length=128)] | None = None
    """OpenAI's end-user tag: accepted, not used for anything."""
    joint: StrictBool = False
    """vLLM's: all questions read at once, which only its diffusion models do (refused here)."""
    cache_salt: str | None = None
    """Salts the prefix cache of every question's prompt."""

    @model_validator(mode="before")
    @classmethod
    def _no_images(cls, data: Any) -> Any:
        """An image part is refused by name (before the union of input shapes reports a type mismatch)."""
        messages = data.get("input") if isinstance(data, dict) else None
        for i, m in enumerate(messages if isinstance(messages, list) else []):
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in parts):
                raise ValidationError("the Decisions API here takes text input only: input_image parts cannot be "
                                      "read", param=f"input[{i}].content")
        return data


class PredicateAnswer(BaseModel):
    type: Literal["predicate"] = "predicate"
    name: str | None
    probability: float


class ChoiceProbability(BaseModel):
    value: str | bool
    probability: float


class ChoiceAnswer(BaseModel):
    type: Literal["choice"] = "choice"
    name: str | None
    choice: str | bool
    probabilities: list[ChoiceProbability]
    confidence: float


class ScoreProbability(BaseModel):
    value: int
    label: str
    probability: float


class ScoreAnswer(BaseModel):
    type: Literal["score"] = "score"
    name: str | None
    score: float
    probabilities: list[ScoreProbability]
    confidence: float


class DecisionInputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class DecisionOutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class DecisionUsage(BaseModel):
    input_tokens: int
    input_tokens_details: DecisionInputTokensDetails
    output_tokens: int
    output_tokens_details: DecisionOutputTokensDetails
    total_tokens: int


class DecisionResponse(BaseModel):
    model: str
    answers: list[PredicateAnswer | ChoiceAnswer | ScoreAnswer]
    usage: DecisionUsage


# ---------------------------------------------------------------------------------------------- /v1/systemone
class QuestionSpec(BaseModel):
    """One question of /v1/systemone: its type name ("choice", "noul", "score"), instructions and criteria (whose
    shape the type says). Other fields are kept to be refused by name (400 "unknown field(s)")."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr
    instructions: Any = ""
    criteria: Any = None


class StructuredDecisionRequest(OpenAIModel):
    """POST /v1/systemone (an unknown field is a 400 naming it)."""

    model: str | None = None
    state: Any
    """What the questions are about: a string, or any JSON value (shown to the model as compact JSON)."""
    questions: dict[str, QuestionSpec]
    """Question id -> question, answered in this order."""
    instructions: str | None = None
    """A system message before the state (none when null or empty)."""
    images: list[str] | None = None
    """vLLM's media inputs: refused here (text models only), as vLLM refuses them for a model that does not see."""
    audio: list[str] | None = None
    videos: list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """More chat template variables; enable_thinking must stay off (the read is the reply's first token)."""
    joint: StrictBool = False
    """vLLM's joint reads (its diffusion models only): refused here."""
    cache_salt: str | None = None
    priority: int = 0
    """vLLM's: only 0 (this server does not schedule by priority)."""
    request_id: str | None = None
    """Named in the response's id (``decision-<request_id>``); default a random one."""


class QuestionDiagnostics(BaseModel):
    label_mass: float
    """The labels' total probability over the whole vocabulary (low: the model wanted to say something else)."""
    argmax_is_label: bool
    """Whether the model's greedy token was one of the question's labels."""


class StructuredDecisionUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class StructuredDecisionResponse(BaseModel):
    id: str
    object: Literal["structured_decision"] = "structured_decision"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    answers: dict[str, dict[str, Any]]
    usage: StructuredDecisionUsage
    diagnostics: dict[str, QuestionDiagnostics]
    joint: None = None
    """vLLM's joint-read diagnostics: always null here (no joint reads)."""
