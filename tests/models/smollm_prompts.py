"""The prompts the default-model tests share: plain and chat-templated, 3 to 400 tokens, non-Latin too."""
from __future__ import annotations

from typing import Any

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
