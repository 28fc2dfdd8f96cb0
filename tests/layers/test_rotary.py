"""Rotary frequencies: GGUF's per-frequency divisors reproduce Llama 3.1 scaling; unknown types are refused."""
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
        _inv_freq(64, 10000.0, {"rope_type": "longrope", "factor": 4.0})
    assert err.value.param == "rope_scaling"
