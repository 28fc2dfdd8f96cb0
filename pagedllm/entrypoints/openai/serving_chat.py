"""POST /v1/chat/completions."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.processor import render_chat
from pagedllm.entrypoints.openai.chat_options import (
    TemplateOptions,
    check_reasoning_effort,
    echoed_text,
    template_options,
)
from pagedllm.entrypoints.openai.chat_stream import ChoiceDeltas
from pagedllm.entrypoints.openai.limits import check_constraint, check_request_tokens, check_tools
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionTokensDetails,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningConfig, ReasoningParser, ReasoningSplit
from pagedllm.entrypoints.openai.serving import (
    SSE_DONE,
    OpenAIServing,
    StreamGroup,
    counted_logprobs,
    finite_logprob,
    merge_streams,
    prompt_logprobs_json,
    shown_logprobs,
    sse,
    token_label,
)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.tool_calls import ToolParser, call_id, constrained_calls, constraint, tool_functions
from pagedllm.errors import ValidationError, quoted
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams, reasoning_token_count

ROLES = ("system", "developer", "user", "assistant", "tool")
"""OpenAI's roles. Another role is passed to the chat template as vLLM passes it (a template that refuses it is a
400 naming messages), if it is a name: 1 to MAX_ROLE_CHARS letters, digits, '_' or '-'."""
MAX_ROLE_CHARS = 64


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: Any, models: OpenAIServingModels, reasoning_parser: ReasoningParser | None = None,
                 tool_parser: ToolParser | None = None, chat_template: str | None = None) -> None:
        super().__init__(engine, models)
        self.chat_template = chat_template
        """--chat-template: used instead of the model's own (None: the model's)."""
        self.reasoning_parser = reasoning_parser
        """Splits replies into reasoning_content and content (--reasoning-parser); None: all content."""
        self.tool_parser = tool_parser
        """Finds the model's own tool calls for tool_choice="auto" (--tool-call-parser)."""
        self.trust_request_chat_template = False
        """--trust-request-chat-template: a request's own chat_template is run (else refused)."""
        self._reasoning_markers: tuple[list[int], list[int], list[int]] | None = None
        self._implicit_ends: list[int] | None = None
        """The reasoning parser's implicit ends (ReasoningParser.ends_at) that are one token each (tokenized once)."""
        self.reasoning_config = ReasoningConfig()
        """--reasoning-config: the strings thinking_token_budget opens, forces and closes the reasoning with."""

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.force_usage(req)  # (the chat endpoint's own requests: not the Responses or Messages API's)
        run = await self.start(req, raw)
        if run is None:
            return Response(status_code=499)  # the client went away while its request was prepared
        if req.stream:
            events = (sse(chunk) async for chunk in self.chunks(run, req))
            return StreamingResponse(self.with_error_events(_then_done(events)), media_type="text/event-stream")
        completion = await self.response(run, raw)
        if completion is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(completion.model_dump())

    async def start(self, req: ChatCompletionRequest, raw: Request) -> ChatRun | None:
        """Check the request, render its prompt and queue it (None: the client went away meanwhile). The one
        request path of chat completions, and of the Responses and Messages APIs mapped onto it."""
        self.check_runnable(req)
        prep = await self.prepare(req)
        shown_id = self.reply_id("chatcmpl", raw, req.request_id)
        streams = await self.add_all(random_id("chatcmpl"), [{"prompt_token_ids": prep.prompt_ids,
                                                              "prompt": prep.text}], prep.params, prep.lora, raw)
        if streams is None:
            return None
        run = ChatRun(shown_id, prep.model, streams, prep.tools, len(prep.prompt_ids),
                      shown_logprobs(req, prep.logprobs), list(prep.prompt_ids) if req.return_token_ids else None,
                      as_ids=self.as_token_ids(req), prompt_logprobs=req.prompt_logprobs is not None)
        run.hide_reasoning = not req.include_reasoning and self.reasoning_parser is not None
        run.reasoning = prep.reasoning
        run.echo = echoed_text(req.messages, req.add_generation_prompt, self._content) if req.echo else ""
        return run

    async def prepare(self, req: ChatCompletionRequest) -> ChatPrepared:
        """Everything a chat request is checked and turned into before it is queued: its model, its rendered
        prompt and its sampling params (400 naming what is wrong). Shared by ``start`` and the render routes."""
        model, lora = self.check_model(req.model)
        self.check_limits(req)
        check_tools(req.tools, self.limits)
        tools = _ToolMode.of(req, self.tool_parser)
        self.check_prompt_size(req.messages, "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise ValidationError("top_logprobs needs logprobs=true", param="top_logprobs", value=req.top_logprobs)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, logprobs, req.stream, req.prompt_logprobs)
        options = template_options(req, self.trust_request_chat_template)
        check_reasoning_effort(options, options.chat_template or self.chat_template or
                               getattr(self.tokenizer, "chat_template", None))
        self._thinking_budget(req, params)
        self._check_waiting([req.messages])  # (a full queue sheds it before it is rendered)
        text, prompt_ids = await self.render(req.messages, req.add_generation_prompt, req.tools, options)
        check_request_tokens(self.limits, self.max_model_len, [self.filled(max_tokens, len(prompt_ids))], req.n,
                             req.stream, counted_logprobs(req, logprobs), [len(prompt_ids)], req.prompt_logprobs,
                             names=("max_completion_tokens" if req.max_completion_tokens is not None else
                                    "max_tokens", "top_logprobs"))
        if tools.constraint is not None:  # as vLLM, the forced call is the constraint: response_format gives way
            if req.structured_outputs is not None:  # (vLLM refuses it with a named function, ignores it otherwise)
                raise ValidationError("structured_outputs cannot be combined with tool_choice 'required' or a named "
                                      "function (the forced tool call is the reply's constraint)",
                                      param="structured_outputs")
            check_constraint(tools.constraint, self.limits, "tools", count_bytes=False)  # the tools' own byte cap
            params.structured_outputs = tools.constraint
        reasoning = None if self.reasoning_parser is None else self.reasoning_parser.for_request(options.kwargs, text)
        if reasoning is not None and reasoning.reasons_first and params.structured_outputs is not None:
            self.grammar_after_reasoning(params, reasoning)  # (a thinking budget's forced end, then the grammar)
        return ChatPrepared(model, lora, tools, params, text, list(prompt_ids), reasoning, logprobs)

    async def response(self, run: ChatRun, raw: Request | None) -> ChatCompletionResponse | None:
        """The finished reply of a queued request (None: the client disconnected first; ``raw`` None: no client
        waits on it)."""
        outputs = await self.outputs(run.streams, raw)
        if outputs is None:
            return None
        out = outputs[0]
        choices = []
        for c in out.outputs:
            message, finish = self.message_of(c.text, c.finish_reason, run.tools, run.reasoning)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=self.logprobs_of(c, run.logprobs, run.as_ids),
                                      finish_reason=finish, stop_reason=c.stop_reason,
                                      token_ids=None if run.prompt_ids is None else list(c.token_ids)))
        for choice in choices:  # include_reasoning false, echo
            self.shown(run, choice)
            if run.echo:
                choice.message.content = run.echo + (choice.message.content or "")
        completion = sum(len(c.token_ids) for c in out.outputs)
        usage = self.usage(run.prompt_tokens, completion, max(out.num_cached_tokens, 0))
        self._count_reasoning(run, usage, out.prompt_token_ids, [c.token_ids for c in out.outputs])
        return ChatCompletionResponse(id=run.request_id, model=run.model, choices=choices, usage=usage,
                                      prompt_logprobs=prompt_logprobs_json(getattr(out, "prompt_logprobs", None))
                                      if run.prompt_logprobs else None,
                                      prompt_token_ids=run.prompt_ids,
                                      metrics=self.request_metrics(out, len(out.outputs), completion))

    @staticmethod
    def shown(run: ChatRun, choice: ChatChoice | ChatStreamChoice) -> bool:
        """Whether a choice (or a streamed one's chunk) still says something once include_reasoning false took out
        its reasoning, and with it its logprobs and token ids (which would show it), as vLLM does."""
        if not run.hide_reasoning:
            return True
        message = choice.message if isinstance(choice, ChatChoice) else choice.delta
        message.reasoning_content = None
        choice.logprobs, choice.token_ids = None, None
        return bool(message.content or message.tool_calls or choice.finish_reason)

    def message_of(self, text: str, finish_reason: str | None, tools: _ToolMode,
                 reasoning: ReasoningParser | None = None) -> tuple[ChatResponseMessage, str | None]:
        """One finished choice: (its message, its finish_reason: "tool_calls" when it called tools, except a call
        forced by name, which ends with "stop" as OpenAI and vLLM report it; "length", as vLLM, when max_tokens
        ended it, with the calls if the forced call's JSON was complete by then, else none). ``reasoning``: the
        request's reasoning parser (None: all content)."""
        split = ReasoningSplit(None, text) if reasoning is None else reasoning.split(text)
        calls = []
        content = split.content
        if tools.constraint is not None and finish_reason in ("stop", "length"):
            try:
                calls, content = constrained_calls(split.content or "", tools.named), None
            except ValueError:  # cut by max_tokens before the JSON ended (the grammar makes a whole reply parse), or
                # ended inside the reasoning, before the grammar began (it holds what follows the reasoning)
                assert finish_reason == "length" or not split.content, "a forced tool call that finished must parse"
                content = None  # as vLLM's test: no call (its arguments would not parse), no content
        elif tools.parser is not None:
            content, calls = tools.parser.parse(split.content or "")
        calls = calls if tools.parallel else calls[:1]
        message = ChatResponseMessage(content=content, reasoning_content=split.reasoning, tool_calls=[
            ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])
        called = calls and finish_reason != "length" and tools.named is None
        return message, "tool_calls" if called else finish_reason

    async def render(self, messages: list[ChatMessage], add_generation_prompt: bool,
                     tools: list[dict] | None = None, options: TemplateOptions | None = None
                     ) -> tuple[str, list[int]]:
        """apply_chat_template in the engine's tokenizer thread (a template and a long prompt take a while: never
        on the event loop)."""
        return await self.engine.in_tokenizer_thread(self.apply_chat_template, messages, add_generation_prompt, tools,
                                                     options)

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool,
                            tools: list[dict] | None = None, options: TemplateOptions | None = None
                            ) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a conversation (and its tools), through the model's chat template (or the
        request's, ``options``: with its continue_final_message and template variables)."""
        if not messages:
            raise ValidationError("messages must not be empty", param="messages", value=messages)
        conversation = []
        for i, m in enumerate(messages):
            entry: dict[str, Any] = {"role": self._role(i, m), "content": self._content(i, m) or m.refusal or ""}
            if m.audio is not None:
                raise ValidationError(f"messages[{i}].audio is not supported by this server (it has no audio "
                                      "output); send it as null or leave it out", param=f"messages[{i}].audio")
            calls = list(m.tool_calls or [])
            if m.function_call is not None:  # the legacy shape of one call: shown to the template as tool_calls
                calls.append({"type": "function", "function": m.function_call.model_dump()})
            if calls:
                entry["tool_calls"] = calls
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content  # (vLLM's: reasoning wins)
            if reasoning is not None:  # templates read either name (Qwen3's reasoning_content, newer ones reasoning)
                entry["reasoning_content"] = entry["reasoning"] = reasoning
            conversation.append(entry)
        options = options or TemplateOptions()
        try:
            return render_chat(self.tokenizer, conversation, options.chat_template or self.chat_template,
                               add_generation_prompt, tools, options.continue_final_message, options.kwargs)
        except ValidationError:
            raise
        except Exception as e:  # a variable of the client's (or its own template) broke the template: its 400
            if options.chat_template is None and not options.kwargs:
                raise
            param = "chat_template" if options.chat_template is not None else "chat_template_kwargs"
            raise ValidationError(f"the chat template failed with this request's {param}: {type(e).__name__}: "
                                  f"{str(e)[:300]}", param=param) from e

    def _marker_ids(self) -> tuple[list[int], list[int], list[int]] | None:
        """(start, forced end, natural end) of the reasoning as token ids (tokenized once), from --reasoning-config
        and the reasoning parser's markers; None where neither names both ends."""
        markers = self.reasoning_config.markers(self.reasoning_parser)
        if markers is None:
            return None
        if self._reasoning_markers is None:
            encode = self.tokenizer.encode
            self._reasoning_markers = tuple(encode(m, add_special_tokens=False) for m in markers)  # type: ignore
        return self._reasoning_markers

    def _count_reasoning(self, run: ChatRun, usage: UsageInfo, prompt: list[int], outputs: list[list[int]]) -> None:
        """With a reasoning parser, as vLLM: usage.completion_tokens_details.reasoning_tokens, the generated tokens
        inside reasoning sections (counted on the token ids once the reply is done; a reply the request's parser
        reads as starting in its reasoning counts from its first token)."""
        if self.reasoning_parser is None:
            return
        start, _, end = self._marker_ids() or ([], [], [])
        inside = run.reasoning is not None and run.reasoning.thinking and run.reasoning.starts_inside
        count = sum(reasoning_token_count(prompt, list(ids), start, end, inside) for ids in outputs)
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=count)

    def grammar_after_reasoning(self, params: SamplingParams, reasoning: ReasoningParser) -> None:
        """As vLLM with a reasoning parser: the reply starts inside the reasoning, so its grammar holds only after
        the reasoning's end marker (or from an implicit end that is a single token, qwen3's ``<tool_call>``)."""
        markers = self._marker_ids()
        if markers is None:  # (a parser always names both markers)
            return
        params.grammar_after_reasoning = True
        params.reasoning_end_token_ids = list(markers[2])
        if reasoning.ends_at:
            if self._implicit_ends is None:
                encoded = (self.tokenizer.encode(m, add_special_tokens=False) for m in reasoning.ends_at)
                self._implicit_ends = [ids[0] for ids in encoded if len(ids) == 1]
            params.reasoning_implicit_end_token_ids = list(self._implicit_ends) or None

    def _thinking_budget(self, req: ChatCompletionRequest, params: SamplingParams) -> None:
        """thinking_token_budget into ``params``, with the reasoning parser's markers as token ids (400 without a
        parser: nothing then says where reasoning starts and ends)."""
        budget = req.thinking_token_budget
        if budget is None or budget == -1:
            return
        if budget < 0:
            raise ValidationError.bad_value("thinking_token_budget", budget, "an integer >= 0, or -1 for no cap")
        markers = self._marker_ids()
        if markers is None:
            raise ValidationError("thinking_token_budget needs the server started with --reasoning-parser or a "
                                  "--reasoning-config naming reasoning_start_str and reasoning_end_str (they say "
                                  "where the reasoning starts and ends)", param="thinking_token_budget",
                                  value=budget)
        start, forced, end = markers
        params.reasoning_start_token_ids, params.reasoning_end_token_ids = list(start), list(end)
        params.reasoning_forced_end_token_ids = list(forced) if forced != end else None
        params.thinking_token_budget = budget

    @staticmethod
    def _role(index: int, message: ChatMessage) -> str:
        role = message.role
        if role not in ROLES and not (0 < len(role) <= MAX_ROLE_CHARS and role.replace("_", "").replace("-", "")
                                      .isascii() and role.replace("_", "").replace("-", "").isalnum()):
            raise ValidationError(f"messages[{index}].role must be one of {list(ROLES)} or a custom role's name "
                                  f"(1 to {MAX_ROLE_CHARS} ASCII letters, digits, '_' or '-'), got {quoted(role)}",
                                  param=f"messages[{index}].role", value=role)
        return role

    @staticmethod
    def _content(index: int, message: ChatMessage) -> str:
        content = message.content
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise ValidationError(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                                      param=f"messages[{index}].content", value=part.type)
            texts.append(part.text)
        return "".join(texts)

    def logprobs_of(self, c: CompletionOutput, top_n: int | None, as_ids: bool = False) -> ChatLogprobs | None:
        """OpenAI's logprobs of a choice's tokens; ``as_ids`` (return_tokens_as_token_ids): each token named
        "token_id:<id>" (its bytes stay its text's, as vLLM's)."""
        if c.logprobs is None or top_n is None:
            return None
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs):
            sampled = entry[token_id]
            text = sampled.decoded_token or ""
            top = [TopLogprob(token=token_label(t, lp.decoded_token, as_ids), logprob=finite_logprob(lp.logprob),
                              bytes=list((lp.decoded_token or "").encode()))
                   for t, lp in self.top_entries(entry, top_n)]
            content.append(ChatTokenLogprob(token=token_label(token_id, text, as_ids),
                                            logprob=finite_logprob(sampled.logprob), bytes=list(text.encode()),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)

    async def chunks(self, run: ChatRun, req: ChatCompletionRequest
                     ) -> AsyncIterator[ChatCompletionStreamResponse]:
        """A queued request's reply as chat completion chunks (the last with the usage, if asked); errors
        raise (the caller turns them into its API's error event)."""
        request_id, model, streams, prompt_tokens = run.request_id, run.model, run.streams, run.prompt_tokens
        every_chunk = req.stream_options is not None and req.stream_options.every_chunk
        generated: dict[int, int] = {}  # per choice, its tokens so far (continuous usage)
        completion_tokens, cached_tokens = 0, 0

        def chunk(choice: ChatStreamChoice) -> ChatCompletionStreamResponse:
            usage = self.usage(prompt_tokens, generated.get(choice.index, 0), cached_tokens) if every_chunk else None
            return ChatCompletionStreamResponse(id=request_id, model=model, choices=[choice], usage=usage)

        ids = run.prompt_ids is not None  # return_token_ids
        for index in range(req.n):  # the first chunk of each choice names the role (the very first: the prompt ids)
            first = chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            if index == 0:
                first.prompt_token_ids = run.prompt_ids
            yield first
        for index in range(req.n if run.echo else 0):  # echo: the last message's text, then the reply
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(content=run.echo)))
        deltas = {index: ChoiceDeltas(self, run, hold_ids=True) for index in range(req.n)}
        generated_ids: dict[int, list[int]] = {}  # per choice, its token ids (a reasoning parser counts them)
        prompt_ids: list[int] = []
        last = None  # the request's last output (its timing: --enable-per-request-metrics)
        async for _, out in merge_streams(streams):
            last = out
            prompt_tokens, prompt_ids = len(out.prompt_token_ids), out.prompt_token_ids
            cached_tokens = max(cached_tokens, out.num_cached_tokens)
            for c in out.outputs:
                if self.reasoning_parser is not None:  # (the usage's reasoning tokens are counted on the ids)
                    generated_ids.setdefault(c.index, []).extend(c.token_ids)
                completion_tokens += len(c.token_ids)
                generated[c.index] = generated.get(c.index, 0) + len(c.token_ids)
                choice = deltas[c.index].next(c, ids)
                if choice is not None and self.shown(run, choice):
                    yield chunk(choice)
        if req.stream_options and req.stream_options.include_usage:
            usage = self.usage(prompt_tokens, completion_tokens, cached_tokens)
            self._count_reasoning(run, usage, prompt_ids, list(generated_ids.values()))
            yield ChatCompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage,
                                               metrics=self.request_metrics(last, req.n, completion_tokens))


async def _then_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events, then OpenAI's closing [DONE]."""
    async for event in events:
        yield event
    yield SSE_DONE


@dataclass
class ChatRun:
    """A chat request queued in the engine: what its reply is built from."""

    request_id: str
    model: str
    """The model name to answer with."""
    streams: StreamGroup
    tools: _ToolMode
    prompt_tokens: int
    logprobs: int | None
    """How many top alternatives each token's logprobs list (None: no logprobs)."""
    prompt_ids: list[int] | None = None
    """return_token_ids: the rendered conversation's token ids (None: not asked for)."""
    as_ids: bool = False
    """return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"."""
    hide_reasoning: bool = False
    """include_reasoning false (with a reasoning parser): no reasoning, logprobs or token ids in the reply."""
    reasoning: ReasoningParser | None = None
    """The server's reasoning parser as it reads this request's replies (its template variables and prompt)."""
    echo: str = ""
    """echo: the text the reply's content starts with."""
    prompt_logprobs: bool = False
    """prompt_logprobs was asked for: the reply carries the prompt's."""


@dataclass
class ChatPrepared:
    """A chat request checked and rendered, not yet queued (OpenAIServingChat.prepare)."""

    model: str
    lora: Any
    tools: _ToolMode
    params: SamplingParams
    text: str
    """The rendered prompt."""
    prompt_ids: list[int]
    reasoning: ReasoningParser | None
    logprobs: int | None
    """Top alternatives per token (None: no logprobs)."""


@dataclass
class _ToolMode:
    """What a request's tools and tool_choice ask of its replies."""

    constraint: StructuredOutputsParams | None = None
    """"required" or a named function: the reply is constrained to the call(s)."""
    named: str | None = None
    parser: ToolParser | None = None
    """"auto": the model's own calls are parsed from its reply."""
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.constraint is not None or self.parser is not None

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: ToolParser | None) -> _ToolMode:
        functions = tool_functions(req.tools)
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if functions and parser is not None else "none"
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValidationError.bad_value("tool_choice", choice, "'none', 'auto', 'required' or a named function")
        if choice == "auto" and functions:
            if parser is None:
                raise ValidationError("tool_choice 'auto' needs the server started with --tool-call-parser",
                                      param="tool_choice", value=choice)
            return cls(parser=parser, parallel=req.parallel_tool_calls)
        spec, named = constraint(choice, functions, req.parallel_tool_calls)
        return cls(spec, named, None, req.parallel_tool_calls)
