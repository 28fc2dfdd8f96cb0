"""A GGUF file's tokenizer is converted by transformers once and read from the cache after
(models/loader/gguf_tokenizer.py): the cached one is transformers' own conversion, token for token (read back
and checked before it is kept; tests/models/test_gguf_families.py's Gemma and Qwen2 files through it too); a
damaged cache entry is converted again, a conversion killed halfway leaves only scratch a later save sweeps, as
it sweeps the entries of files removed or changed since, and a cache that cannot be written only costs the speed."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from pagedllm.models.loader import gguf_tokenizer, load_tokenizer

TEXTS = ["Hello world", " leading space", "naïve café 日本語 🎉 \u200b", "<|im_start|>user\nhi<|im_end|>",
         "a\n\n\tb  c\r\n", "x" * 300, "def f(x):\n    return x ** 2  # ok", ""]


class _Conversions:
    """Counts transformers' conversions of a GGUF file's tokenizer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from transformers import AutoTokenizer

        self.count = 0
        original = AutoTokenizer.from_pretrained

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += "gguf_file" in kwargs
            return original(*args, **kwargs)

        monkeypatch.setattr(AutoTokenizer, "from_pretrained", counted)


def _same(a: Any, b: Any) -> None:
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a(text, add_special_tokens=False)["input_ids"] == b(text, add_special_tokens=False)["input_ids"], text
    ids = list(range(0, len(a), 97)) + a.all_special_ids
    assert a.decode(ids) == b.decode(ids) and a.convert_ids_to_tokens(ids) == b.convert_ids_to_tokens(ids)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "chat_template",
                 "add_bos_token", "add_eos_token", "padding_side"):
        assert getattr(a, name, None) == getattr(b, name, None), name
    assert len(a) == len(b) and a.get_vocab() == b.get_vocab()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
    assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def reference(default_model: str) -> Any:
    """transformers' own conversion of the default model's tokenizer (no cache involved)."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_model)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_converted_once_then_read_from_the_cache(default_model: str, reference: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    entries = tmp_path / "tokenizers"
    here = tmp_path / "here.gguf"
    here.write_bytes(b"GGUF")
    for name, source in {"gone": tmp_path / "removed.gguf", "changed": here, "kept": here}.items():
        (entries / name).mkdir(parents=True)
        st = here.stat()
        record = {"path": str(source), "size": st.st_size, "mtime_ns": st.st_mtime_ns + (name == "changed")}
        (entries / name / gguf_tokenizer.SOURCE_FILE).write_text(json.dumps(record))
    (entries / "unmarked").mkdir()  # no record: not ours to judge
    conversions = _Conversions(monkeypatch)
    first = load_tokenizer(default_model)
    assert conversions.count == 1 and gguf_tokenizer.cache_folder(default_model).is_dir()
    # the conversion swept the entries of files removed or changed since: no load can reach them
    assert sorted(p.name for p in entries.iterdir()) == sorted(["kept", "unmarked",
                                                                gguf_tokenizer.cache_folder(default_model).name])
    again = load_tokenizer(default_model)
    assert conversions.count == 1  # read back, not converted
    _same(reference, first)
    _same(reference, again)
    assert not list((tmp_path / "tokenizers").glob("*.tmp-*"))  # no scratch left


def test_damage_scratch_and_an_unwritable_cache(default_model: str, reference: Any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    folder = gguf_tokenizer.cache_folder(default_model)
    folder.parent.mkdir(parents=True)
    stale, fresh = folder.parent / f"{folder.name}.tmp-stale", folder.parent / f"{folder.name}.tmp-running"
    for scratch in (stale, fresh):  # a conversion killed an hour ago, and one running beside this one now
        scratch.mkdir()
        (scratch / "tokenizer.json").write_text('{"half": ')
    old = time.time() - 2 * gguf_tokenizer._STALE_SCRATCH_S
    os.utime(stale, (old, old))
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{not json")  # damaged since it was written
    conversions = _Conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        repaired = load_tokenizer(default_model)
    assert conversions.count == 1 and "does not load" in caplog.text, caplog.text
    _same(reference, repaired)
    assert not stale.exists() and fresh.exists()  # only the killed one is swept
    assert load_tokenizer(default_model) is not None and conversions.count == 1  # the repaired entry is read

    blocked = tmp_path / "not-a-folder"  # a cache that cannot be written (a file where the folder would go)
    blocked.write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocked))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        unsaved = load_tokenizer(default_model)
    assert "could not cache the GGUF tokenizer" in caplog.text and conversions.count == 2, caplog.text
    _same(reference, unsaved)


def test_a_tokenizer_that_does_not_read_back_as_converted_is_not_cached(
        default_model: str, reference: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The saved copy is read back and held to the conversion (PROBE_TEXTS, special tokens, template) before it
    is kept: where it differs, this process keeps the conversion and nothing stays in the cache."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    assert gguf_tokenizer.same_tokenizer(reference, reference)
    assert not gguf_tokenizer.same_tokenizer(reference, object())  # (raises inside: not the same)
    monkeypatch.setattr(gguf_tokenizer, "same_tokenizer", lambda a, b: False)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        kept = load_tokenizer(default_model)
    assert "does not read back as converted" in caplog.text, caplog.text
    assert not gguf_tokenizer.cache_folder(default_model).exists()
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == []
    _same(reference, kept)
