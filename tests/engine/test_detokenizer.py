"""Incremental detokenization (UTF-8 safe) and stop strings cut exactly, also across tokens."""
from __future__ import annotations

from typing import Any

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams


def _feed(tokenizer: Any, text: str, params: SamplingParams) -> tuple[IncrementalDetokenizer, str | None, list[str]]:
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas, stop = [], None
    for token_id in tokenizer.encode(text):
        before = detok.output_text
        stop = detok.update([token_id], stopped_by_token=False)
        deltas.append(detok.output_text[len(before):])
        if stop is not None:
            break
    return detok, stop, deltas


def test_multibyte_characters_are_never_split(tokenizer: Any) -> None:
    text = "温度は摂氏25度です 🌍🚀 naïve café"
    detok, stop, deltas = _feed(tokenizer, text, SamplingParams())
    assert stop is None
    assert detok.output_text == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas), "some tokens hold partial characters and must wait"


def test_stop_string_inside_one_token(tokenizer: Any) -> None:
    detok, stop, _ = _feed(tokenizer, "Hello world. Goodbye world.", SamplingParams(stop=["Goodbye"]))
    assert stop == "Goodbye" and detok.output_text == "Hello world. "


def test_stop_string_split_across_tokens(tokenizer: Any) -> None:
    text = "The answer is forty-two, definitely."
    stop_str = "ty-tw"  # spans several tokens
    ids = tokenizer.encode(text)
    assert not any(stop_str in tokenizer.decode([i]) for i in ids)
    detok, stop, _ = _feed(tokenizer, text, SamplingParams(stop=[stop_str]))
    assert stop == stop_str and detok.output_text == "The answer is for"
    detok, stop, _ = _feed(tokenizer, text, SamplingParams(stop=[stop_str], include_stop_str_in_output=True))
    assert detok.output_text == "The answer is forty-tw"


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    detok, stop, _ = _feed(tokenizer, "one two three four", SamplingParams(stop=["four", "two"]))
    assert stop == "two" and detok.output_text == "one "


def test_stop_strings_wait_for_min_tokens(tokenizer: Any) -> None:
    text = "stop here, then more, stop again"
    n_first = len(tokenizer.encode("stop here"))
    detok, stop, _ = _feed(tokenizer, text, SamplingParams(stop=["stop"], min_tokens=n_first + 1))
    assert stop == "stop" and detok.output_text == "stop here, then more, "


def test_stream_text_holds_back_a_possible_stop_prefix(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["END"]))
    for token_id in tokenizer.encode("abc EN"):
        detok.update([token_id], False)
    assert detok.output_text == "abc EN"
    assert detok.text_for_stream(finished=False) == "abc "
    assert detok.text_for_stream(finished=True) == "abc EN"


def test_skipped_special_tokens_never_grow_the_decode_window(tokenizer: Any) -> None:
    """EOS repeated (as under ignore_eos) adds no text, and each step decodes a short window."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), SamplingParams())
    hello = tokenizer.encode(" hello")
    detok.update(hello, stopped_by_token=False)
    for _ in range(500):
        detok.update([tokenizer.eos_token_id], stopped_by_token=False)
    detok.update(tokenizer.encode(" world"), stopped_by_token=False)
    assert detok.output_text == " hello world" and detok.num_output_tokens == len(hello) + 500 + 1
    assert len(detok._ids) < 20  # the 500 EOS tokens never entered the window
    shown = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), SamplingParams(skip_special_tokens=False))
    shown.update([tokenizer.eos_token_id], stopped_by_token=False)
    assert shown.output_text == tokenizer.eos_token
    # added tokens marked special but not in all_special_ids (SmolLM2's <file_sep>): skipped alike, no window growth
    file_sep = tokenizer.convert_tokens_to_ids("<file_sep>")
    assert file_sep not in tokenizer.all_special_ids and tokenizer.decode([file_sep], skip_special_tokens=True) == ""
    run = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), SamplingParams())
    run.update(hello + [file_sep] * 300 + tokenizer.encode(" world"), stopped_by_token=False)
    assert run.output_text == " hello world" and len(run.carried()[0]) < 20


def test_a_reply_cut_inside_a_character_ends_with_the_last_whole_one(tokenizer: Any) -> None:
    """As vLLM's detokenizer (tokenizers' DecodeStream): a reply cut (max_tokens) inside a multi-byte character
    ends with the last whole character, the cut bytes never shown as U+FFFD (decoding all the reply's ids does show
    one: vLLM's test_chat_return_tokens_as_token_ids_completion compares the two, so it fails whenever the model's
    reply is cut inside a character, on vLLM too)."""
    from tokenizers.decoders import DecodeStream

    ids = tokenizer.encode("🐱🐶🎉", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "the emojis take several tokens each"
    for k in cuts:
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), SamplingParams())
        detok.update(ids[:k], stopped_by_token=False)
        stream = DecodeStream(skip_special_tokens=True)
        vllm_text = "".join(piece or "" for piece in (stream.step(tokenizer._tokenizer, t) for t in ids[:k]))
        assert detok.output_text == vllm_text == tokenizer.decode(ids[:k]).rstrip("\ufffd")
