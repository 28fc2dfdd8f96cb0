"""benchmarks/big_models.py (issue 44): the shaped random checkpoints are real LlamaForCausalLM folders (the names
and shapes transformers writes, bf16 values as promised, the same bytes every build, nothing half-made left), the
bytes a decode step reads are counted right, and a run starts the commands it should. No engine is run here."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MICRO = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=512, tie_word_embeddings=False, max_position_embeddings=512, rope_theta=10000.0,
             rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False, mlp_bias=False)


@pytest.fixture()
def big(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tokenizer: Any) -> ModuleType:
    import pagedllm.models.loader

    monkeypatch.setattr(pagedllm.models.loader, "load_tokenizer", lambda path: tokenizer)  # the suite's, loaded once
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports compare.py beside it
    spec = importlib.util.spec_from_file_location("big_models", ROOT / "benchmarks" / "big_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(module.SHAPES, "micro", MICRO)
    return module


@pytest.mark.parametrize("tied", [True, False])
def test_tensor_specs_are_transformers_names_and_shapes(big: ModuleType, tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**MICRO, "tie_word_embeddings": tied}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert dict(big.tensor_specs(cfg)) == want


def test_checkpoint_is_built_once_whole_and_reads_back(big: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    monkeypatch.setattr(big, "SHARD_BYTES", 2 * 512 * 64 * 2 - 1)  # the two vocab tables cannot share a shard
    folder = big.build_hf("micro")
    assert sorted(os.listdir(os.path.dirname(folder))) == ["hf"]  # renamed into place: no .tmp left
    index = json.loads(Path(folder, "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    seen = {}
    for file in files:
        with safe_open(os.path.join(folder, file), "pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == file
                seen[name] = f.get_tensor(name)
    assert {k: tuple(v.shape) for k, v in seen.items()} == dict(big.tensor_specs(MICRO))
    assert all(t.dtype == torch.bfloat16 for t in seen.values())
    assert torch.equal(seen["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    down = seen["model.layers.1.mlp.down_proj.weight"].float()
    assert abs(down.std().item() - big.WEIGHT_STD) < 0.002 and abs(down.mean().item()) < 0.002
    assert not torch.equal(seen["model.embed_tokens.weight"], seen["lm_head.weight"])  # per-tensor seeds
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in seen.values())
    config = AutoConfig.from_pretrained(folder)
    assert (config.hidden_size, config.num_key_value_heads, config.eos_token_id) == (64, 2, 2)
    assert (Path(folder) / "tokenizer.json").exists()
    stamp = os.path.getmtime(os.path.join(folder, files[0]))
    assert big.build_hf("micro") == folder and os.path.getmtime(os.path.join(folder, files[0])) == stamp  # cached
    again = Path(folder).parent / "again.safetensors"  # the same bytes from the same seed
    specs = [s for s in big.tensor_specs(MICRO) if index["weight_map"][s[0]] == files[0]]
    big.write_safetensors(str(again), specs, 0)
    assert again.read_bytes() == Path(folder, files[0]).read_bytes()


def test_bytes_one_decode_step_reads(big: ModuleType) -> None:
    untied = big.weight_read_bytes("micro", "hf")
    tables = 512 * 64 * 2
    assert untied == sum(big._nbytes(d) for _, d in big.tensor_specs(MICRO)) - tables  # one row of the embedding
    assert big.weight_read_bytes("tiny", "hf") == sum(big._nbytes(d) for _, d in big.tensor_specs(big.SHAPES["tiny"]))
    assert big.kv_bytes_per_token("smollm2-1.7b") == 24 * 2 * 32 * 64 * 2  # ~196 KB (MHA)
    assert big.kv_bytes_per_token("llama-8b") == 32 * 2 * 8 * 128 * 2


def test_flops_of_forward_passes(big: ModuleType) -> None:
    """Every layer's projections per token (2 FLOPs a weight), the LM head per logits row, QK and PV per attended
    (query, key) pair: at the 1.7B shape ~1.61 G weights a token in the layers, 100.7 M in the LM head."""
    layer = 2048 * (2 * 2048 + 2 * 2048) + 3 * 2048 * 8192
    assert big.forward_flops("smollm2-1.7b", 1, 0, 0) == 2 * 24 * layer and 24 * layer == 1_610_612_736
    assert big.forward_flops("smollm2-1.7b", 0, 1, 0) == 2 * 2048 * 49152
    assert big.forward_flops("smollm2-1.7b", 0, 0, 1) == 4 * 64 * 32 * 24
    assert big.forward_flops("llama-8b", 0, 0, 1) == 4 * 128 * 32 * 32  # every query head of the GQA groups


def test_machine_probes(big: ModuleType) -> None:
    """The streaming read and the GEMM probe give rates, at 1 thread and at every core for the read."""
    rates = big.read_bandwidth(2**24, reps=1)
    assert set(rates) == {f"{n}_threads" for n in {1, os.cpu_count()}} and all(v > 0 for v in rates.values())
    assert big.gemm_rate(size=64, reps=1) > 0


def test_dry_run_names_every_engine_on_the_same_files(big: ModuleType, capsys: pytest.CaptureFixture) -> None:
    big.main(["run", "--shape", "smollm2-1.7b", "--num-prompts", "8", "--dry-run"])
    out = capsys.readouterr().out
    home = os.path.join(big.CACHE, "smollm2-1.7b")
    lines = [line for line in out.splitlines() if not line.startswith("#") and ": spec " not in line]
    commands = dict(line.split(": ", 1) for line in lines)
    assert set(commands) == {f"{part} {engine}" for part in ("decode", "ttft", "throughput", "load")
                             for engine in big.PART_ENGINES[part]} | {"spec ours-bf16 ngram", "spec ours-bf16 draft"}
    q4km = os.path.join(home, "smollm2-1.7b.Q4_K_M.gguf")
    assert f"--gguf {q4km}" in commands["decode llamacpp-q4km"] and "--input-len 128 --gen 64" in commands[
        "decode llamacpp-q4km"]
    assert "--input-len 4096 --gen 1" in commands["ttft llamacpp-bf16"]
    assert "--mode batched --parallel 8 --num-prompts 8" in commands["throughput llamacpp-q4km"]
    hf = os.path.join(home, "hf")
    for engine in ("ours-bf16", "vllm-bf16"):
        assert f"--model {hf}" in commands[f"throughput {engine}"] and "--load-format dummy" in commands[
            f"throughput {engine}"]
    assert f"--kv-cache-memory {4 * 2**30}" in commands["throughput ours-bf16"]
    assert "--kv-cache-gb 4" in commands["throughput openvino-bf16"]
    assert commands["decode vllm-bf16"].split()[:4] == [big.VLLM_CPU, "python", big.PROBE, "vllm"]
    assert commands["decode ours-q4km"].split()[:4] == [sys.executable, big.PROBE, "pagedllm", "decode"]
    assert commands["spec ours-bf16 draft"].split()[:4] == [sys.executable, big.PROBE, "pagedllm", "spec"]
    specs = {line.split(": spec ")[0]: json.loads(line.split(": spec ", 1)[1]) for line in out.splitlines()
             if line.startswith("spec ") and ": spec " in line}
    ngram, draft = (specs[f"spec ours-bf16 {m}"]["kwargs"] for m in ("ngram", "draft"))
    assert ngram["load_format"] == draft["load_format"] == "dummy" and ngram["dtype"] == "bfloat16"
    assert ngram["speculative_config"]["method"] == "ngram" and ngram["speculative_config"]["min_acceptance_rate"] == 0
    assert draft["speculative_config"]["model"] == os.path.join(home, "draft-smollm2-135m")
    assert draft["speculative_config"]["num_speculative_tokens"] == 5


def test_draft_folder_is_config_only_with_the_targets_vocabulary(big: ModuleType) -> None:
    """The spec part's draft: a config-only folder beside hf/ that our loader reads as the shape asked for."""
    from pagedllm.models.loader import load_arch_config

    big.DRAFTS["micro"] = ("micro-draft", {**MICRO, "hidden_size": 32, "num_hidden_layers": 1})
    try:
        folder = big.build_draft("micro")
    finally:
        del big.DRAFTS["micro"]
    assert folder == os.path.join(big.CACHE, "micro", "draft-micro-draft") and os.listdir(folder) == ["config.json"]
    assert sorted(os.listdir(os.path.dirname(folder))) == ["draft-micro-draft", "hf"]  # renamed into place
    arch, target = load_arch_config(folder), load_arch_config(os.path.join(big.CACHE, "micro", "hf"))
    assert (arch.hidden_size, arch.num_layers, arch.vocab_size) == (32, 1, target.vocab_size)
    smollm = big.DRAFTS["smollm2-1.7b"][1]  # SmolLM2-135M, as the default model's GGUF has it
    assert (smollm["hidden_size"], smollm["num_hidden_layers"], smollm["num_attention_heads"],
            smollm["num_key_value_heads"], smollm["intermediate_size"]) == (576, 30, 9, 3, 1536)
    assert all(big.DRAFTS[s][1]["vocab_size"] == big.SHAPES[s]["vocab_size"] for s in big.DRAFTS)


class _FakeEngine:
    """Steps of a scripted request: (seconds, new tokens, drafts verified, drafts accepted) each."""

    def __init__(self, script: list[tuple[float, int, int, int]], clock: list[float]) -> None:
        self.script, self.clock, self.tokens, self.drafts, self.accepted = list(script), clock, [], 0, 0

    def add_request(self, request_id: str, prompt: dict, params: Any) -> None:
        self.request_id = request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.script)

    def step(self) -> list[Any]:
        seconds, new, drafts, accepted = self.script.pop(0)
        self.clock[0] += seconds
        self.tokens += [7] * new
        self.drafts, self.accepted = self.drafts + drafts, self.accepted + accepted
        output = type("Completion", (), {"token_ids": list(self.tokens)})
        return [type("Output", (), {"request_id": self.request_id, "outputs": [output]})]

    def get_stats(self) -> Any:
        self.clock[0] += 100.0  # reading the counters is outside the timed steps
        return type("Stats", (), {"spec_decode_num_draft_tokens": self.drafts,
                                  "spec_decode_num_accepted_tokens": self.accepted})


def test_spec_probe_times_each_step_and_classes_it_by_its_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("big_models_probe", ROOT / "benchmarks" / "big_models_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    clock = [0.0]
    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    # the prompt's step (1 token), a plain step, two that verified 5 drafts (one rejecting 2), one of 3 drafts
    script = [(5.0, 1, 0, 0), (0.1, 1, 0, 0), (0.2, 6, 5, 5), (0.4, 4, 5, 3), (0.3, 4, 3, 3)]
    llm = type("LLM", (), {"llm_engine": _FakeEngine(script, clock)})
    params = lambda **kw: kw  # noqa: E731  (SamplingParams' keywords as given)
    result, tokens = probe.stepped_request(llm, params, "r", [1] * 10, 16, True)
    assert tokens == [7] * 16 and result["tokens"] == 16 and result["decode_steps"] == 4
    assert result["decode_s"] == pytest.approx(1.0) and result["decode_tok_per_s"] == pytest.approx(15.0)
    assert (result["draft_tokens"], result["accepted_tokens"]) == (13, 11)
    assert result["acceptance"] == pytest.approx(11 / 13) and result["tokens_per_step"] == pytest.approx(15 / 4)
    by = result["by_drafts"]
    assert set(by) == {"0", "3", "5"} and by["0"]["steps"] == 1 and by["0"]["mean_context"] == 11
    assert by["5"]["median_s"] == pytest.approx(0.3) and by["5"]["mean_context"] == pytest.approx((12 + 18) / 2)
