"""vLLM's other ways into an embedding model, against a real `pagedllm serve` (issue 45 point 8): long inputs
embedded in chunks (--pooler-config enable_chunked_processing / max_embed_len), chat-shaped input (messages on
/v1/embeddings and /pooling) and Cohere's POST /v2/embed. One server runs them all: the tiny random BERT embedder
of test_pooling_server with a chat template, task prompts and chunked processing on."""
from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tests.entrypoints.openai.test_pooling_server import MAX_LEN, TEXTS, _cos, _post, _refused, folders  # noqa: F401
from tests.utils import RemoteServer

MAX_EMBED_LEN = 150
"""The server's max_embed_len: inputs up to this many tokens are embedded in chunks of MAX_LEN."""
TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = {"query": "query: ", "document": ""}
LONG_TEXT = " ".join(f"word{i % 7} the cat" for i in range(30))
"""~100 tokens: four chunks of MAX_LEN."""
CONVERSATION = [{"role": "user", "content": "the cat sat on the mat"},
                {"role": "assistant", "content": "a feline rested on a rug"},
                {"role": "user", "content": "stars twinkle at night"}]


def _rendered(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """TEMPLATE rendered by hand."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + (
        "assistant:" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def chunk_folder(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The embedder, with sentence-transformers prompts (Cohere's input_type)."""
    folder = tmp_path_factory.mktemp("chunked") / "embed"
    shutil.copytree(folders["embed"], folder)
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    return folder


@pytest.fixture(scope="module")
def chunk_server(chunk_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(TEMPLATE)
    srv = RemoteServer(chunk_folder, "--served-model-name", "bert", "--max-model-len", str(MAX_LEN),
                       "--max-prompts", "8", "--chat-template", str(template), "--pooler-config",
                       json.dumps({"enable_chunked_processing": True, "max_embed_len": MAX_EMBED_LEN}))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def bert_tokenizer(chunk_folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chunk_folder)


def _vectors(client: openai.OpenAI, value: Any, **extra: Any) -> tuple[list[list[float]], int]:
    out = client.embeddings.create(model="bert", input=value, encoding_format="float", **extra)
    return [d.embedding for d in out.data], out.usage.prompt_tokens


def _close(a: Any, b: Any, tol: float = 1e-5) -> bool:
    return bool(np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), atol=tol))


# ---------------------------------------------------------------------------------------------------------------
# long inputs in chunks


def test_a_long_input_is_the_weighted_mean_of_its_chunks(chunk_server: RemoteServer, chunk_folder: Path,
                                                         bert_tokenizer: Any) -> None:
    from sentence_transformers import SentenceTransformer

    client = chunk_server.get_client()
    ids = bert_tokenizer(LONG_TEXT)["input_ids"]
    assert 3 * MAX_LEN < len(ids) <= MAX_EMBED_LEN
    chunks = [ids[i:i + MAX_LEN] for i in range(0, len(ids), MAX_LEN)]
    per_chunk, chunk_tokens = _vectors(client, chunks)  # each fits: embedded as it is
    weights = np.array([len(c) for c in chunks], dtype=np.float64)
    mean = (np.asarray(per_chunk) * weights[:, None]).sum(0) / weights.sum()
    [got], tokens = _vectors(client, LONG_TEXT)
    assert tokens == chunk_tokens == len(ids)
    assert _close(got, mean / np.linalg.norm(mean))
    [by_ids], _ = _vectors(client, ids)  # token ids are chunked the same way
    assert _close(by_ids, got)
    # not normalized: the plain weighted mean of the raw chunk vectors
    raw_chunks, _ = _vectors(client, chunks, extra_body={"normalize": False})
    [raw], _ = _vectors(client, LONG_TEXT, extra_body={"normalize": False})
    assert _close(raw, (np.asarray(raw_chunks) * weights[:, None]).sum(0) / weights.sum())
    [raw_too], _ = _vectors(client, LONG_TEXT, extra_body={"use_activation": False})  # vLLM 0.34's name of it
    assert _close(raw_too, raw)
    # a short input is not changed by the flag (sentence-transformers' own embedding), also next to a long one
    want = SentenceTransformer(str(chunk_folder), device="cpu").encode(TEXTS[:2])
    both, _ = _vectors(client, [TEXTS[0], LONG_TEXT, TEXTS[1]])
    assert _cos(both[0], want[0]) > 0.99999 and _cos(both[2], want[1]) > 0.99999
    assert _close(both[1], got)
    # truncate_prompt_tokens still cuts instead of chunking
    assert _vectors(client, LONG_TEXT, extra_body={"truncate_prompt_tokens": 16})[1] == 16


def test_inputs_over_max_embed_len_are_refused(chunk_server: RemoteServer) -> None:
    client = chunk_server.get_client()
    too_long = " ".join(["word"] * (MAX_EMBED_LEN + 10))
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="bert", input=too_long)
    assert e.value.body["param"] == "input" and "max_embed_len" in e.value.body["message"]
    _refused(_post(chunk_server, "/v1/embeddings", {"input": ["short", too_long]}), "input[1]", "max_embed_len")
    _refused(_post(chunk_server, "/v1/embeddings", {"input": [[1000] * (MAX_EMBED_LEN + 1)]}), "input[0]")
    # /pooling does not chunk (vLLM's neither): max_model_len holds there
    _refused(_post(chunk_server, "/pooling", {"input": LONG_TEXT}), "input", str(MAX_LEN))


# ---------------------------------------------------------------------------------------------------------------
# chat-shaped input


def test_messages_are_rendered_through_the_chat_template(chunk_server: RemoteServer,
                                                          bert_tokenizer: Any) -> None:
    client = chunk_server.get_client()
    prompt = _rendered(CONVERSATION)
    [plain], plain_tokens = _vectors(client, prompt, extra_body={"add_special_tokens": False})
    [by_ids], _ = _vectors(client, bert_tokenizer.encode(prompt, add_special_tokens=False))
    assert _close(plain, by_ids)
    [in_input], tokens = _vectors(client, CONVERSATION)  # a conversation given as input, as vLLM takes it
    assert _close(in_input, plain) and tokens == plain_tokens
    body = _post(chunk_server, "/v1/embeddings", {"model": "bert", "messages": CONVERSATION}).json()
    assert _close(body["data"][0]["embedding"], plain) and body["usage"]["prompt_tokens"] == plain_tokens
    special = _post(chunk_server, "/v1/embeddings", {"messages": CONVERSATION, "add_special_tokens": True}).json()
    assert special["usage"]["prompt_tokens"] == plain_tokens + 2  # [CLS] and [SEP]
    prompted = _post(chunk_server, "/v1/embeddings", {"messages": CONVERSATION, "add_generation_prompt": True})
    assert prompted.json()["usage"]["prompt_tokens"] == len(
        bert_tokenizer.encode(_rendered(CONVERSATION, True), add_special_tokens=False))
    two = _post(chunk_server, "/v1/embeddings", {"messages": [CONVERSATION, CONVERSATION[:1]]}).json()
    assert len(two["data"]) == 2 and _close(two["data"][0]["embedding"], plain)
    pooled = _post(chunk_server, "/pooling", {"messages": CONVERSATION}).json()
    assert _close(pooled["data"][0]["data"], plain)
    both = _post(chunk_server, "/v1/embeddings", {"messages": CONVERSATION, "continue_final_message": True,
                                                  "add_generation_prompt": True})
    _refused(both, "continue_final_message", "Cannot set both")
    _refused(_post(chunk_server, "/pooling", {"messages": [CONVERSATION, CONVERSATION]}), "messages")
    _refused(_post(chunk_server, "/v1/embeddings", {"input": "a", "messages": CONVERSATION}), "messages")
    _refused(_post(chunk_server, "/v1/embeddings", {"input": "a", "add_generation_prompt": True}),
             "add_generation_prompt")
    _refused(_post(chunk_server, "/v1/embeddings", {"messages": CONVERSATION, "chat_template": "{{ 1 }}"}),
             "chat_template", "--trust-request-chat-template")
    _refused(_post(chunk_server, "/v1/embeddings", {"model": "bert"}), "input")


# ---------------------------------------------------------------------------------------------------------------
# Cohere's /v2/embed


def test_cohere_embed_matches_openai_embeddings(chunk_server: RemoteServer) -> None:
    client = chunk_server.get_client()
    texts = TEXTS[:3]
    want, tokens = _vectors(client, texts)
    r = _post(chunk_server, "/v2/embed", {"model": "bert", "texts": texts,
                                          "embedding_types": ["float", "binary", "ubinary", "base64"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("embd-") and body["response_type"] == "embeddings_by_type"
    assert body["texts"] == texts
    assert body["meta"] == {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens,
                                                                              "image_tokens": 0}}
    got = body["embeddings"]
    assert _close(got["float"], want)
    bits = np.packbits(np.asarray(want) >= 0, axis=-1).astype(int)
    assert got["ubinary"] == bits.tolist() and got["binary"] == (bits - 128).tolist()
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in got["base64"]]
    assert _close(decoded, want)
    default = _post(chunk_server, "/v2/embed", {"texts": texts[:1]}).json()["embeddings"]
    assert list(default) == ["float"] and _close(default["float"][0], want[0])


def test_cohere_input_type_inputs_and_truncate(chunk_server: RemoteServer, bert_tokenizer: Any) -> None:
    client = chunk_server.get_client()
    text = TEXTS[1]

    def cohere(**body: Any) -> list[float]:
        r = _post(chunk_server, "/v2/embed", {"embedding_types": ["float"], **body})
        assert r.status_code == 200, r.text
        return r.json()["embeddings"]["float"][0]

    # with a chat template, input_type's prefix is a system message before the text (vLLM's rendering)
    as_chat = [{"role": "system", "content": PROMPTS["query"]}, {"role": "user", "content": text}]
    [want], _ = _vectors(client, as_chat)
    assert _close(cohere(texts=[text], input_type="query"), want)
    [plain], _ = _vectors(client, text)
    assert _close(cohere(texts=[text], input_type="document"), plain)  # an empty prefix: the text as it is
    [user], _ = _vectors(client, [{"role": "user", "content": "a cat" + "on a mat"}])
    assert _close(cohere(inputs=[{"content": [{"type": "text", "text": "a cat"}, {"type": "text",
                                                                                  "text": "on a mat"}]}]), user)
    # truncate: END keeps the first tokens, START the last ([CLS] and [SEP] kept), NONE embeds the whole (chunks)
    long = " ".join(f"w{i}" for i in range(40))
    ids = bert_tokenizer(long)["input_ids"]
    body = ids[1:-1]
    keep = MAX_LEN - 2
    [end], _ = _vectors(client, [ids[0], *body[:keep], ids[-1]])
    [start], _ = _vectors(client, [ids[0], *body[-keep:], ids[-1]])
    [whole], _ = _vectors(client, long)
    assert not _close(end, start, 1e-3) and not _close(end, whole, 1e-3)
    assert _close(cohere(texts=[long]), end) and _close(cohere(texts=[long], truncate="END"), end)
    assert _close(cohere(texts=[long], truncate="START"), start)
    assert _close(cohere(texts=[long], truncate="NONE"), whole)
    [cut8], _ = _vectors(client, [ids[0], *body[:6], ids[-1]])
    assert _close(cohere(texts=[long], max_tokens=8), cut8)
    _refused(_post(chunk_server, "/v2/embed", {"texts": ["x", long], "truncate": "NONE", "max_tokens": 10}),
             "texts[1]", "max_tokens")


def test_cohere_refusals_name_the_field(chunk_server: RemoteServer, server: RemoteServer) -> None:
    def refused(body: dict, param: str, *words: str) -> None:
        _refused(_post(chunk_server, "/v2/embed", body), param, *words)

    refused({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types", "int8")
    refused({"texts": ["a"], "input_type": "classification"}, "input_type", "Unsupported input_type")
    refused({"texts": ["a"], "output_dimension": 8}, "output_dimension")
    refused({"images": ["data:image/png;base64,AAAA"]}, "images")
    refused({"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "inputs[0].content[0]")
    refused({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "a"}]}]}, "texts")
    refused({"model": "bert"}, "texts")
    refused({"texts": []}, "texts")
    refused({"texts": ["a"], "truncate": "MIDDLE"}, "truncate")
    refused({"texts": ["a"], "priority": 1}, "priority")
    refused({"texts": ["a"], "color": "red"}, "color")
    refused({"texts": ["a", " ".join(["word"] * (MAX_EMBED_LEN + 10))], "truncate": "NONE"}, "texts[1]",
            "max_embed_len")
    _refused(_post(server, "/v2/embed", {"texts": ["a"]}), "model", "/v1/completions")
