"""The prompts the default-model tests share: plain and chat-templated, 3 to 400 tokens, non-Latin too."""
from __future__ import annotations

from pathlib import Path
from typing import Any

PROSE = Path(__file__).parents[1] / "data" / "prose.txt"
"""Public-domain prose shipped with the tests (3,133 tokens of the default model): perplexity runs."""

MAX_TOKENS = 32
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "東京は日本の首都です。大阪は",
    "Once upon a time",
]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain in the world?"}],
    [{"role": "user", "content": "Расскажи коротко о Москве."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."},
     {"role": "assistant", "content": "2, 3, 5."},
     {"role": "user", "content": "Three more, please."}],
]
LONG_TEXT = ("PagedAttention stores the key-value cache of every request in fixed-size blocks that need not be "
             "contiguous in memory, much like virtual memory pages in an operating system. ")


def smollm_prompt_ids(tokenizer: Any) -> list[list[int]]:
    """Plain and chat-templated prompts from 3 to 400 tokens."""
    ids = [tokenizer.encode(p) for p in PLAIN]
    for conv in CHATS:
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    long_ids = tokenizer.encode(LONG_TEXT * 20)
    ids.append(long_ids[:400])
    chat_long = tokenizer.apply_chat_template([{"role": "user", "content": "Summarise: " + LONG_TEXT * 6}],
                                              tokenize=False, add_generation_prompt=True)
    ids.append(tokenizer.encode(chat_long, add_special_tokens=False))
    ids.append(tokenizer.encode("Hi there!"))
    lengths = sorted(len(i) for i in ids)
    assert lengths[0] == 3 and lengths[-1] == 400 and len(ids) >= 8, lengths
    return ids


def greedy_and_perplexity(model: str, tokenizer: Any, variants: list[dict[str, Any]], max_tokens: int = 32
                          ) -> tuple[list[list[list[int]]], list[float], list[int]]:
    """For each variant (LLM options; KV pool 256 MiB unless given): greedy tokens of the first 8 prompts,
    the perplexity of PROSE (windows of 512) and the KV blocks; each engine shut down before the next starts."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.bench.perplexity import perplexity

    prompts = [{"prompt_token_ids": ids} for ids in smollm_prompt_ids(tokenizer)[:8]]
    prose = tokenizer.encode(PROSE.read_text(encoding="utf-8"), add_special_tokens=False)
    assert len(prose) > 3000
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runs, values, blocks = [], [], []
    for options in variants:
        llm = LLM(model, **{"kv_cache_memory": "256MiB", **options})
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        values.append(perplexity(llm, prose))
        blocks.append(llm.llm_engine.num_kv_blocks)
        llm.shutdown()
    return runs, values, blocks


def common_prefixes(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """How many tokens each pair of greedy outputs shares before its first difference."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]
