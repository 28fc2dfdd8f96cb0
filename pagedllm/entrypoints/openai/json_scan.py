"""How many values a JSON body holds and how deep it nests, read from its raw bytes before it is parsed.

``json.loads`` and pydantic hold the GIL for the whole of a body: 2.6M tiny values (``[],`` inside
``tool_calls``) kept the event loop, and ``/health`` with it, frozen for seconds (a worker thread would not
help: neither releases the GIL). So the body's shape is bounded first, at C speed: ``bytes.count`` gives an
upper bound that clears every ordinary body at once; a body over it (or any large body) is scanned exactly with
numpy, in chunks, outside its strings. numpy releases the GIL in its loops, so a large body is scanned in a
worker thread while the loop goes on.
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import numpy as np

from pagedllm.errors import ValidationError

CHUNK = 1 << 20
"""Bytes scanned per numpy pass: bounds the scan's temporary arrays (~20 bytes per byte) to ~20 MiB."""
_QUOTE, _BACKSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_OPEN, _CLOSE = np.zeros(256, np.bool_), np.zeros(256, np.bool_)
_OPEN[[ord("["), ord("{")]] = True
_CLOSE[[ord("]"), ord("}")]] = True


def quick_bounds(body: bytes) -> tuple[int, int]:
    """(values, depth) upper bounds from byte counts alone (structural bytes inside strings count too)."""
    openers = body.count(b"[") + body.count(b"{")
    return openers + body.count(b","), openers


def _scan(body: bytes) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Per chunk of ``body``: (its offset, its bytes, which are outside strings, the nesting level after each)."""
    in_string, backslashes, depth = 0, 0, 0
    for start in range(0, len(body), CHUNK):
        a = np.frombuffer(body, np.uint8, count=min(CHUNK, len(body) - start), offset=start)
        slash = a == _BACKSLASH
        quote = a == _QUOTE
        run = None
        if backslashes or slash.any():  # (most chunks have no escapes: skip this part)
            # the backslash run ending at each byte (carried over from the last chunk): a quote after an odd
            # run is escaped
            index = np.arange(a.size, dtype=np.int32)
            run = index - np.maximum.accumulate(np.where(slash, np.int32(-1 - backslashes), index))
            quote &= np.concatenate(([backslashes], run[:-1])) % 2 == 0
        inside = (np.cumsum(quote, dtype=np.int32) + in_string) % 2 == 1  # a structural byte is never a quote
        outside = ~inside
        level = np.cumsum((_OPEN[a] & outside).astype(np.int32) - (_CLOSE[a] & outside), dtype=np.int32) + depth
        yield start, a, outside, level
        depth, in_string = int(level[-1]), int(inside[-1])
        backslashes = int(run[-1]) if run is not None and slash[-1] else 0


def json_shape(body: bytes, max_values: int | None = None) -> tuple[int, int]:
    """(values, depth) of a JSON text: values counts containers, array elements and object members (each
    ``[``, ``{`` and ``,`` outside strings: exact for valid JSON, an empty container counting one); depth is the
    deepest nesting of arrays and objects. O(len(body)) in numpy, stopping after the chunk that passes
    ``max_values`` (the counts so far are returned: over the bound either way); a text that is not JSON gets
    some count (its parse then fails on its own)."""
    values, deepest = 0, 0
    for _, a, outside, level in _scan(body):
        values += int(np.count_nonzero((_OPEN[a] | (a == _COMMA)) & outside))
        deepest = max(deepest, int(level.max()))
        if max_values is not None and values > max_values:
            break
    return values, deepest


_KEY = re.compile(rb'\s*"((?:[^"\\]|\\.)*)"', re.S)


def largest_member(body: bytes) -> str | None:
    """The key of the top-level member that spans the most bytes of a JSON object text (None: none found): the
    field an over-large body is named by."""
    starts = [np.flatnonzero(((a == _COMMA) | _OPEN[a]) & outside & (level == 1)) + offset
              for offset, a, outside, level in _scan(body)]
    bounds = np.concatenate([*starts, [len(body)]])
    if bounds.size < 2:
        return None
    at = int(bounds[int(np.argmax(np.diff(bounds)))]) + 1  # after the member's "{" or ","
    key = _KEY.match(body, at)
    try:
        return json.loads(b'"' + key.group(1) + b'"') if key else None
    except ValueError:
        return None


SCAN_INLINE_BYTES = 1 << 20
"""A body up to this size is scanned on the event loop (tens of ms at worst); a larger one in a worker thread."""


async def check_json_shape(body: bytes, max_values: int, max_depth: int) -> None:
    """ValidationError (400, naming the top-level field that holds most of the body, and the flag) when ``body``
    holds more than ``max_values`` JSON values or nests deeper than ``max_depth``, before anything parses it."""
    values, depth = quick_bounds(body)
    if values <= max_values and depth <= max_depth:
        return  # every ordinary body: a few bytes.count calls
    if len(body) > SCAN_INLINE_BYTES:
        values, depth = await asyncio.to_thread(json_shape, body, max_values)
    else:
        values, depth = json_shape(body, max_values)
    if values <= max_values and depth <= max_depth:
        return
    param = await asyncio.to_thread(largest_member, body) if len(body) > SCAN_INLINE_BYTES else largest_member(body)
    where = f"{param} in the request body" if param is not None else "the request body"
    if values > max_values:
        raise ValidationError(f"{where} holds over {max_values} JSON values (arrays, objects and their entries); "
                              f"this server parses at most {max_values} in one request (--max-json-values)",
                              param=param, value=values)
    raise ValidationError(f"{where} nests {depth} levels deep; this server parses at most {max_depth} "
                          "(--max-json-depth)", param=param, value=depth)
