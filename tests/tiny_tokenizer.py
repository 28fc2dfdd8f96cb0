"""A word-level tokenizer over "t0" .. "t{n-1}" for tiny random models that need one on disk (the engine
loads a tokenizer; prompts in these tests are token ids). No pytest import: benchmarks use it too."""
from __future__ import annotations

from pathlib import Path


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """Save it to ``path`` (ids 0, 1, 2: unknown, BOS, EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)
