"""Pooling without a model: the pooling ops against per-sequence torch, PoolingParams and the engine's checks,
the sentence-transformers folder reader, and the scheduler's handling of pooling requests (whole inputs in one
step, no blocks for an encoder, finished with their vector)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pagedllm.config import ModelConfig, PoolerConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.core import resolve_pooling_params
from pagedllm.engine.scoring import cosine, score_pairs
from pagedllm.errors import ValidationError
from pagedllm.layers.pooler import Pooler, pool
from pagedllm.models.loader.sentence_transformers import read_sentence_transformers_config
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.utils import make_scheduler


@pytest.mark.parametrize("pooling_type", ["CLS", "MEAN", "LAST", "MAX"])
def test_pool_matches_per_sequence_reference(pooling_type: str) -> None:
    torch.manual_seed(0)
    lens = [1, 7, 3, 12]
    hidden = torch.randn(sum(lens), 16)
    got = pool(hidden, lens, pooling_type)
    want, start = [], 0
    for n in lens:
        seq = hidden[start:start + n]
        want.append({"CLS": seq[0], "LAST": seq[-1], "MEAN": seq.mean(0), "MAX": seq.max(0).values}[pooling_type])
        start += n
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-6, atol=1e-6)


class _Head(torch.nn.Module):
    default_pooling_type = "LAST"

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled[:, :3] * 2.0


def test_pooler_embed_dimensions_normalize_and_classify_activation() -> None:
    torch.manual_seed(1)
    lens = [2, 3, 4]
    hidden = torch.randn(sum(lens), 8)
    pooler = Pooler(_Head(), PoolerConfig(pooling_type="MEAN", normalize=True))
    embed = [PoolingParams(task="embed", normalize=True), PoolingParams(task="embed", normalize=False),
             PoolingParams(task="embed", normalize=True, dimensions=4)]
    out = pooler(hidden, lens, embed)
    means = pool(hidden, lens, "MEAN")
    torch.testing.assert_close(torch.tensor(out[0]), torch.nn.functional.normalize(means[0], dim=0))
    torch.testing.assert_close(torch.tensor(out[1]), means[1])
    assert len(out[2]) == 4 and abs(torch.tensor(out[2]).norm().item() - 1) < 1e-6  # cut, then normalized
    mixed = pooler(hidden, lens, [PoolingParams(task="classify", use_activation=True), embed[1],
                                  PoolingParams(task="classify", use_activation=False)])
    last = pool(hidden, lens, "LAST")[:, :3] * 2.0
    torch.testing.assert_close(torch.tensor(mixed[0]), torch.softmax(last[0], -1))
    torch.testing.assert_close(torch.tensor(mixed[1]), means[1])
    torch.testing.assert_close(torch.tensor(mixed[2]), last[2])


def test_pooling_params_refuse_bad_values_naming_them() -> None:
    for kwargs, param in (({"task": "generate"}, "task"), ({"dimensions": 0}, "dimensions"),
                          ({"normalize": "yes"}, "normalize"),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                          ({"dimensions": True}, "dimensions")):
        with pytest.raises(ValidationError) as e:
            PoolingParams(**kwargs)
        assert e.value.param == param


def _model(convert: str, labels: tuple[str, ...] = (), matryoshka: tuple[int, ...] | None = None) -> ModelConfig:
    return ModelConfig(model="m", dtype="float32", max_model_len=64, runner="pooling", convert=convert,
                       pooler=PoolerConfig(pooling_type="MEAN", normalize=False, matryoshka_dimensions=matryoshka),
                       labels=labels)


def test_resolve_pooling_params_fills_defaults_and_refuses_what_the_model_cannot_do() -> None:
    embed = _model("embed")
    assert resolve_pooling_params(PoolingParams(), embed, 32) == PoolingParams(task="embed", normalize=False)
    assert resolve_pooling_params(PoolingParams(task="score"), embed, 32).task == "embed"  # cosine of embeddings
    assert resolve_pooling_params(PoolingParams(dimensions=32), embed, 32).dimensions == 32  # its own size
    for params, param in ((PoolingParams(task="classify"), "task"), (PoolingParams(dimensions=8), "dimensions"),
                          (PoolingParams(use_activation=True), "use_activation")):
        with pytest.raises(ValidationError) as e:
            resolve_pooling_params(params, embed, 32)
        assert e.value.param == param
    assert resolve_pooling_params(PoolingParams(dimensions=8), _model("embed", matryoshka=(8, 16)), 32).dimensions == 8
    with pytest.raises(ValidationError, match="one of"):
        resolve_pooling_params(PoolingParams(dimensions=9), _model("embed", matryoshka=(8, 16)), 32)
    cross = _model("classify", labels=("LABEL_0",))
    assert resolve_pooling_params(PoolingParams(task="score"), cross, 32) == PoolingParams(task="classify",
                                                                                          use_activation=True)
    with pytest.raises(ValidationError) as e:
        resolve_pooling_params(PoolingParams(task="score"), _model("classify", labels=("a", "b", "c")), 32)
    assert e.value.param == "task"
    with pytest.raises(ValidationError) as e:
        resolve_pooling_params(PoolingParams(normalize=True), cross, 32)
    assert e.value.param == "normalize"


def _st_folder(tmp_path, pooling: dict, modules: list[dict] | None = None) -> str:
    folder = str(tmp_path)
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    mods = modules or [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                       {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(mods, f)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 128, "do_lower_case": False}, f)
    return folder


def test_sentence_transformers_folder_is_read_as_it_is(tmp_path) -> None:
    assert read_sentence_transformers_config(str(tmp_path)) is None  # not a sentence-transformers folder
    cfg = read_sentence_transformers_config(_st_folder(tmp_path, {"pooling_mode_mean_tokens": True}))
    assert (cfg.pooling_type, cfg.normalize, cfg.max_seq_length) == ("MEAN", True, 128)
    with pytest.raises(ValidationError, match="weightedmean"):
        read_sentence_transformers_config(_st_folder(tmp_path, {"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ValidationError, match="exactly one"):
        read_sentence_transformers_config(_st_folder(tmp_path, {"pooling_mode_cls_token": True,
                                                                "pooling_mode_mean_tokens": True}))
    dense = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
             {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
             {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    with pytest.raises(ValidationError, match="Dense"):
        read_sentence_transformers_config(_st_folder(tmp_path, {"pooling_mode_cls_token": True}, dense))


def _pooling_request(req_id: str, n: int) -> Request:
    return Request(req_id, list(range(1, n + 1)), SamplingParams(max_tokens=1), (), 0,
                   pooling_params=PoolingParams(task="embed", normalize=True))


def _pooled_output(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[],
                             pooler_output={r: [float(n)] for r, n in out.num_scheduled_tokens.items()})


@pytest.mark.parametrize("num_kv_blocks", [0, 32])
def test_scheduler_runs_pooling_inputs_whole_and_finishes_them(num_kv_blocks: int) -> None:
    """0 blocks: an encoder (no pool at all); 32: a decoder embedder (blocks taken, freed with the finish)."""
    s = make_scheduler(num_kv_blocks=num_kv_blocks, max_num_batched_tokens=10)
    for req_id, n in (("a", 6), ("b", 5), ("c", 3)):
        s.add_request(_pooling_request(req_id, n))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 6}  # b does not fit whole: it waits, nothing is chunked
    assert out.scheduled_new_reqs[0].pooling_params.task == "embed"
    assert (out.scheduled_new_reqs[0].block_ids == []) == (num_kv_blocks == 0)
    news = s.update_from_output(_pooled_output(out))
    assert [(n.request_id, n.finish_reason, n.pooling_output) for n in news] == [("a", "stop", [6.0])]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 5, "c": 3} and out.finished_req_ids == {"a"}
    s.update_from_output(_pooled_output(out))
    assert not s.has_unfinished_requests() and s.kv_cache_manager.usage() == 0.0
    with pytest.raises(ValidationError) as e:  # longer than one step: it could never run
        s.add_request(_pooling_request("d", 11))
    assert e.value.param == "input"


def test_score_pairs_and_cosine() -> None:
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    with pytest.raises(ValidationError):
        score_pairs(["x", "y"], ["a", "b", "c"])
    with pytest.raises(ValidationError):
        score_pairs([], ["a"])
    assert cosine([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0) and cosine([0.0, 0.0], [1.0, 1.0]) == 0.0
