"""Pooling: one vector per sequence from a flat batch of hidden states, then the task's head.

A step's hidden states are (tokens, hidden), the sequences one after the other with no padding. A
sequence's vector is its first token's (CLS), last token's (LAST: decoder embedders), the mean or the
max over its tokens. "embed" then cuts to ``dimensions`` (Matryoshka) and normalizes; "classify" runs the
model's classification head on the pooled vector (its own pooling: CLS for BERT-style cross-encoders,
LAST for decoder classifiers) and its activation, as transformers' loss for the checkpoint's ``problem_type``
implies (and vLLM applies): a softmax, a sigmoid per label for multi-label classifiers, none for regression
heads of several outputs; a sigmoid for one label (cross-encoders' scores).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.config import PoolerConfig
from pagedllm.pooling_params import PoolingParams

POOLING_TYPES = ("CLS", "MEAN", "LAST", "MAX")


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """(tokens, hidden) states of sequences of ``seq_lens`` tokens -> (sequences, hidden) float32."""
    assert sum(seq_lens) == hidden.shape[0] and all(n > 0 for n in seq_lens), (seq_lens, hidden.shape)
    lens = torch.tensor(seq_lens, device=hidden.device)
    ends = lens.cumsum(0)
    if pooling_type == "CLS":
        return hidden[ends - lens].float()
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    segment = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)  # (tokens,) seq index
    out = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if pooling_type == "MEAN":  # float32 sums token by token (a cumsum difference would cancel digits away)
        return out.index_add_(0, segment, hidden.float()) / lens.unsqueeze(1)
    assert pooling_type == "MAX", pooling_type
    return out.scatter_reduce_(0, segment.unsqueeze(1).expand(-1, hidden.shape[1]), hidden.float(), "amax",
                               include_self=False)


def classify_activation(logits: torch.Tensor, problem_type: str) -> torch.Tensor:
    """(sequences, num_labels) logits -> what a classify or score request returns with ``use_activation`` on.
    One label is always a sigmoid: scores are cross-encoders' (sentence-transformers' CrossEncoder default and
    vLLM's scores, whatever the config's problem_type)."""
    if logits.shape[1] == 1 or problem_type == "multi_label_classification":
        return torch.sigmoid(logits)
    if problem_type == "regression":
        return logits
    return torch.softmax(logits, dim=-1)


def _gather(hidden: torch.Tensor, seq_lens: list[int], rows: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The hidden states (tokens, hidden) and lengths of sequences ``rows`` only."""
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rows]).to(hidden.device)
    return hidden[index], [seq_lens[i] for i in rows]


class Pooler:
    """Turns a step's hidden states into each pooling request's output vector."""

    def __init__(self, model: torch.nn.Module, config: PoolerConfig, problem_type: str = "") -> None:
        """``problem_type``: a classifier's (ArchConfig.problem_type), which picks its activation."""
        self.model = model
        self.config = config
        self.problem_type = problem_type

    def __call__(self, hidden: torch.Tensor, seq_lens: list[int], params: list[PoolingParams]) -> list[list[float]]:
        """One vector per sequence (as plain floats) for the sequences of ``hidden`` (tokens, hidden), in order;
        ``params`` are resolved (task set: "embed" or "classify")."""
        out: list[list[float] | None] = [None] * len(params)
        for task in ("embed", "classify"):
            rows = [i for i, p in enumerate(params) if p.task == task]
            if not rows:
                continue
            # the usual step: one task for every sequence, no gather
            states, lens = (hidden, seq_lens) if len(rows) == len(params) else _gather(hidden, seq_lens, rows)
            vectors = self._embed(states, lens, [params[i] for i in rows]) if task == "embed" else \
                self._classify(states, lens, [params[i] for i in rows])
            for i, v in zip(rows, vectors):
                out[i] = v
        assert all(v is not None for v in out), "every request's task is embed or classify"
        return out  # type: ignore[return-value]

    def _embed(self, hidden: torch.Tensor, seq_lens: list[int], params: list[PoolingParams]) -> list[list[float]]:
        pooled = pool(hidden, seq_lens, self.config.pooling_type)
        dims = {p.dimensions for p in params}
        if dims == {None}:  # every request the whole vector: one normalize over the batch
            if all(p.normalize for p in params):
                pooled = F.normalize(pooled, dim=-1)
            elif any(p.normalize for p in params):
                keep = torch.tensor([bool(p.normalize) for p in params], device=pooled.device).unsqueeze(1)
                pooled = torch.where(keep, F.normalize(pooled, dim=-1), pooled)
            return pooled.tolist()
        vectors = []
        for row, p in zip(pooled, params):
            v = row[:p.dimensions] if p.dimensions is not None else row  # Matryoshka: the leading dims
            vectors.append((F.normalize(v, dim=-1) if p.normalize else v).tolist())
        return vectors

    def _classify(self, hidden: torch.Tensor, seq_lens: list[int], params: list[PoolingParams]) -> list[list[float]]:
        pooled = pool(hidden, seq_lens, getattr(self.model, "default_pooling_type", "CLS"))
        logits = self.model.classify(pooled.to(hidden.dtype)).float()  # (sequences, num_labels)
        probs = classify_activation(logits, self.problem_type)
        keep = torch.tensor([p.use_activation is not False for p in params], device=logits.device).unsqueeze(1)
        return torch.where(keep, probs, logits).tolist()
