"""Rotary frequencies: GGUF's per-frequency divisors reproduce Llama 3.1 scaling; LongRoPE's short and long
factors per position equal transformers'; unknown types are refused."""
from __future__ import annotations

import pytest
import torch

from pagedllm.errors import ValidationError
from pagedllm.layers.rotary import _inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_gguf_freq_factors_equal_llama3_scaling() -> None:
    base = _inv_freq(128, 500000.0, None)
    llama3 = _inv_freq(128, 500000.0, LLAMA3)
    factors = (base / llama3).tolist()  # what llama.cpp writes as rope_freqs.weight
    gguf = _inv_freq(128, 500000.0, {"rope_type": "freq_factors", "freq_factors": factors})
    torch.testing.assert_close(gguf, llama3)
    assert not torch.allclose(llama3, base)  # the scaling changes something


def test_unsupported_rope_type_is_refused() -> None:
    with pytest.raises(ValidationError) as err:
        _inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    assert err.value.param == "rope_scaling"


def test_longrope_short_below_the_pretrained_length_long_above() -> None:
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    from pagedllm.layers.rotary import RotaryEmbedding

    short, long = [1.0 + i / 8 for i in range(8)], [2.0 + i / 4 for i in range(8)]
    hf = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                    original_max_position_embeddings=64, pad_token_id=0,
                    rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})
    ours = RotaryEmbedding(16, 512, 10000.0, {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                              "original_max_position_embeddings": 64, "max_position_embeddings": 512},
                           torch.float32)
    for position, seq_len in ((10, 64), (63, 64), (64, 65), (300, 400)):
        inv_freq, attention = _compute_longrope_parameters(hf, seq_len=seq_len)
        angles = position * inv_freq
        want = torch.cat((angles, angles)).cos() * attention
        torch.testing.assert_close(ours.cos_cache[position], want)
    assert attention > 1.0  # factor 8: the attention factor is not a no-op here
