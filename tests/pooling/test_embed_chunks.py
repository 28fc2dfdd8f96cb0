"""Long-text embeddings' arithmetic (chunks and their weighted mean), Cohere's embedding encodings, and the
pooler_config keys that turn chunked processing on (issue 45 point 8); the server tests are in
tests/entrypoints/openai/test_pooling_inputs.py."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from pagedllm.config import PoolerConfig
from pagedllm.entrypoints.openai.embed_chunks import cohere_encode, combine_chunks, split_chunks
from pagedllm.errors import ValidationError
from pagedllm.models.loader.sentence_transformers import read_task_prompts


def test_split_and_combine() -> None:
    assert split_chunks(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert split_chunks([1, 2], 5) == [[1, 2]]
    one = [0.6, 0.8]
    assert combine_chunks([one], [5], True) == one  # one chunk: its own vector, untouched
    mean = combine_chunks([[1.0, 0.0], [0.0, 1.0]], [3, 1], False)
    assert mean == pytest.approx([0.75, 0.25])
    unit = combine_chunks([[1.0, 0.0], [0.0, 1.0]], [3, 1], True)
    assert unit == pytest.approx(np.array([0.75, 0.25]) / np.hypot(0.75, 0.25))


def test_cohere_encodings() -> None:
    vectors = [[0.5, -1.0, 0.0, 2.0, -0.1, 0.3, -0.2, 0.9], [-1.0] * 8]
    assert cohere_encode(vectors, "float") == vectors
    assert cohere_encode(vectors, "ubinary") == [[0b10110101], [0]]
    assert cohere_encode(vectors, "binary") == [[0b10110101 - 128], [-128]]
    decoded = np.frombuffer(base64.b64decode(cohere_encode(vectors, "base64")[0]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(vectors[0])
    with pytest.raises(ValueError, match="multiple of 8"):
        cohere_encode([[1.0] * 6], "binary")


def test_pooler_config_keys() -> None:
    base = PoolerConfig(pooling_type="MEAN")
    cfg = PoolerConfig.from_user(base, '{"use_activation": false, "enable_chunked_processing": true, '
                                       '"max_embed_len": 4096}')
    assert (cfg.normalize, cfg.enable_chunked_processing, cfg.max_embed_len) == (False, True, 4096)
    for bad, param in (({"max_embed_len": 0}, "pooler_config.max_embed_len"),
                       ({"enable_chunked_processing": "yes"}, "pooler_config.enable_chunked_processing"),
                       ({"pooling_type": "MAX", "enable_chunked_processing": True},
                        "pooler_config.enable_chunked_processing"),
                       ({"normalize": True, "use_activation": True}, "pooler_config.use_activation"),
                       ({"chunk_size": 4}, "pooler_config.chunk_size")):
        with pytest.raises(ValidationError) as e:
            PoolerConfig.from_user(base, bad)
        assert e.value.param == param


def test_task_prompts(tmp_path: Path) -> None:
    assert read_task_prompts(str(tmp_path)) == {}
    (tmp_path / "config.json").write_text(json.dumps({"task_instructions": {"query": "Q: ", "n": 3}}))
    assert read_task_prompts(str(tmp_path)) == {"query": "Q: "}
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"doc": ""}}))
    assert read_task_prompts(str(tmp_path)) == {"doc": ""}
