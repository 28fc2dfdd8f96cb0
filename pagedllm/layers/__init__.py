"""Model building blocks: tensor-parallel-ready linear and embedding layers, norms, rotary, sampler."""
