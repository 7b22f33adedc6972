"""Transformer encoders at their real size, written in torch (random weights).

:func:`encoder` is a BERT-style post-norm encoder: token and learned position
embeddings, multi-head self-attention with an additive padding mask built from
``attention_mask``, GELU feed-forward. Batch and sequence length stay free in
the export (positions are sliced to the sequence length, the heads reshaped
from the runtime shape, as real exporters write it). The registry in
:mod:`models.zoo` has a BERT-base encoder (12 x 768, 12 heads, ffn 3072, ~110M
parameters, pooled and per-token outputs) and a 6 x 384 sentence encoder
(~22M parameters, mean-pooled embedding). torch is imported when a builder runs.
"""

from __future__ import annotations

from typing import Any

VOCAB = 30522
MAX_POSITIONS = 512


def encoder(
    layers: int, hidden: int, heads: int, ffn: int, pooling: str, vocab: int = VOCAB
) -> Any:
    """``pooling`` ``cls``: outputs (last hidden state, tanh-pooled [CLS]); ``mean``: the
    mask-weighted mean of the last hidden state."""
    import torch

    nn: Any = torch.nn
    head_dim = hidden // heads

    class Attention(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(hidden, hidden)
            self.k = nn.Linear(hidden, hidden)
            self.v = nn.Linear(hidden, hidden)
            self.out = nn.Linear(hidden, hidden)

        def forward(self, x: Any, bias: Any) -> Any:
            b, s, _ = x.shape

            def split(t: Any) -> Any:
                return t.view(b, s, heads, head_dim).transpose(1, 2)

            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            att = (q @ k.transpose(-1, -2)) * head_dim**-0.5 + bias
            y = att.softmax(-1) @ v
            return self.out(y.transpose(1, 2).reshape(b, s, hidden))

    class Layer(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.att = Attention()
            self.n1 = nn.LayerNorm(hidden, eps=1e-12)
            self.ff = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
            self.n2 = nn.LayerNorm(hidden, eps=1e-12)

        def forward(self, x: Any, bias: Any) -> Any:
            x = self.n1(x + self.att(x, bias))
            return self.n2(x + self.ff(x))

    class Encoder(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, hidden)
            self.pos = nn.Embedding(MAX_POSITIONS, hidden)
            self.norm = nn.LayerNorm(hidden, eps=1e-12)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.pool = nn.Linear(hidden, hidden) if pooling == "cls" else None

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            s = input_ids.shape[1]
            positions = torch.arange(s, device=input_ids.device)
            x = self.norm(self.tok(input_ids) + self.pos(positions)[None])
            bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -1e4
            for layer in self.layers:
                x = layer(x, bias)
            if self.pool is not None:
                return x, torch.tanh(self.pool(x[:, 0]))
            m = attention_mask[:, :, None].to(x.dtype)
            return (x * m).sum(1) / m.sum(1).clamp(min=1.0)

    return Encoder()


def bert_base() -> Any:
    return encoder(12, 768, 12, 3072, "cls")


def sentence_encoder() -> Any:
    """MiniLM-L6-sized: 6 layers, hidden 384, 12 heads, ffn 1536 (~22.7M parameters)."""
    return encoder(6, 384, 12, 1536, "mean")
