"""Stored responses belong to the API key that made them (issue 43, point 6), against a real `pagedllm serve`
with two keys: another key's id is a 404 (GET, DELETE) or an unknown previous_response_id, exactly as an id
never stored; one key's stores evict only its own; the store holds (and counts) compressed JSON."""
from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedllm.entrypoints.openai.serving_responses import ResponseStore
from tests.utils import RemoteServer

MODEL = "tiny"
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def keyed(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    """Two keys, a store of 4 responses: 2 for each."""
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", MODEL, "--api-key", KEYS[0], "--api-key", KEYS[1],
                       "--max-stored-responses", "4")
    yield srv
    srv.stop()


def _client(server: RemoteServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _create(client: openai.OpenAI, **fields: object) -> openai.types.responses.Response:
    return client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, temperature=0, **fields)


def _error(call: object, kind: type[openai.APIStatusError], stored_id: str, unknown_id: str) -> dict:
    """The error body of ``call`` (it must raise ``kind``), with the id it names replaced by the unknown one."""
    with pytest.raises(kind) as e:
        call()
    return json.loads(json.dumps(e.value.body).replace(stored_id, unknown_id))


def test_another_keys_response_is_as_unknown_as_one_never_stored(keyed: RemoteServer) -> None:
    a, b = _client(keyed, KEYS[0]), _client(keyed, KEYS[1])
    mine = _create(a)
    unknown = "resp_" + "0" * 32
    assert a.responses.retrieve(mine.id).output_text == mine.output_text
    # GET, DELETE, cancel and previous_response_id of A's response with B's key: the very answer an unknown id
    # gets (a background one still running too)
    running = a.responses.create(model=MODEL, input="Go on.", max_output_tokens=400, background=True)
    for call, kind in ((lambda i: b.responses.retrieve(i), openai.NotFoundError),
                       (lambda i: b.responses.delete(i), openai.NotFoundError),
                       (lambda i: b.responses.cancel(i), openai.NotFoundError),
                       (lambda i: _create(b, previous_response_id=i), openai.BadRequestError)):
        theirs = _error(lambda call=call: call(mine.id), kind, mine.id, unknown)
        assert theirs == _error(lambda call=call: call(unknown), kind, unknown, unknown)
    unknown_cancel = _error(lambda: b.responses.cancel(unknown), openai.NotFoundError, unknown, unknown)
    assert _error(lambda: b.responses.cancel(running.id), openai.NotFoundError, running.id, unknown) == unknown_cancel
    # nothing B did touched it: A still reads, continues and deletes it
    assert a.responses.retrieve(mine.id).id == mine.id
    try:  # A's own cancel works (unless 400 tokens of the tiny model were already done: then it is a 400)
        assert a.responses.cancel(running.id).status == "cancelled"
    except openai.BadRequestError:
        assert a.responses.retrieve(running.id).status == "incomplete"
    assert _create(a, previous_response_id=mine.id, store=False).status in ("completed", "incomplete")
    a.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(mine.id)


def test_one_keys_stores_evict_only_its_own(keyed: RemoteServer) -> None:
    a, b = _client(keyed, KEYS[0]), _client(keyed, KEYS[1])
    kept = [_create(a).id for _ in range(2)]  # A's share of the 4: 2
    for _ in range(6):  # B fills (and refills) its own share
        _create(b)
    assert [a.responses.retrieve(i).id for i in kept] == kept
    newest = _create(a).id  # A's third evicts A's least recently used, nothing of B's
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(kept[0])
    assert a.responses.retrieve(kept[1]).id == kept[1] and a.responses.retrieve(newest).id == newest


def _response(i: int) -> tuple[dict, list[dict]]:
    """A stored response as the server builds one: a reply's text, and the request's tool schema echoed (many
    small values, each a Python object of a hundred bytes or more for a few bytes of JSON)."""
    schema = {"type": "object", "properties": {f"field_{k}": {"type": "string"} for k in range(300)}}
    text = " ".join(f"word{k} of reply {i}" for k in range(300))
    response = {"id": f"resp_{i}", "object": "response", "tools": [{"type": "function", "name": "f",
                                                                       "parameters": schema}],
                "output": [{"id": f"msg_{i}", "type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]}
    return response, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}]


def test_the_bytes_counted_are_the_bytes_held() -> None:
    """What the store counts covers what it holds once a request's own objects are gone (the old store counted
    JSON bytes and held the Python objects, several times larger)."""
    store = ResponseStore(max_count=1000, max_bytes=2**30)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(100):
        store.put(*_response(i))
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(store) == 100 and held <= store.bytes, (held, store.bytes)
    assert store.get("resp_7") == _response(7)
