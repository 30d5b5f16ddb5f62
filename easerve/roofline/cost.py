"""FLOP and byte counts of the building blocks (a linear layer, attention, a transformer block).

Counting rules (stated once, used everywhere):
- a linear layer over `t` tokens, `din` -> `dout`: 2*t*din*dout FLOPs; bytes = its weights
  (din*dout) + its input and output activations (t*(din+dout)), times the dtype's bytes;
  biases, norms, activation functions and residual adds are left out (a few % at most);
- attention over sequences of length s with h heads of dim d: QK^T and AV are 4*s*s*h*d FLOPs
  (causal: 4*h*d*s*(s+1)/2); bytes = reading Q, K, V and writing the output (4*s*h*d), the
  scores are taken as fused (flash / SDPA) and never written;
- decode attention of one new token over a context of c tokens: 4*c*h*d FLOPs; bytes = reading
  the context's K and V (2*c*kv_heads*d).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """Work of one call on one device: FLOPs, bytes moved to and from memory, layers run (each
    pays the spec's per-layer overhead), and tensor-parallel all-reduces (payload bytes, count)."""
    flops: float = 0.0
    bytes: float = 0.0
    layers: int = 0
    allreduce_bytes: float = 0.0
    allreduces: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.layers + other.layers,
                    self.allreduce_bytes + other.allreduce_bytes, self.allreduces + other.allreduces)

    def __mul__(self, n: int) -> "Cost":
        return Cost(self.flops * n, self.bytes * n, self.layers * n, self.allreduce_bytes * n, self.allreduces * n)

    __rmul__ = __mul__


def linear(tokens: int, din: int, dout: int, dtype_bytes: int) -> Cost:
    return Cost(2.0 * tokens * din * dout, float(din * dout + tokens * (din + dout)) * dtype_bytes)


def attention(seqs: list[int], heads: int, head_dim: int, dtype_bytes: int, causal: bool = False) -> Cost:
    hd = heads * head_dim
    pairs = sum(s * (s + 1) / 2 if causal else s * s for s in seqs)
    return Cost(4.0 * pairs * hd, 4.0 * sum(seqs) * hd * dtype_bytes)


@dataclass(frozen=True)
class Block:
    """One transformer layer's shapes: attention (`heads`, `kv_heads`, `head_dim`) and an MLP
    (`gated`: SwiGLU's gate + up + down; else fc1 + fc2)."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated: bool

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def params(self) -> int:
        mlp = (3 if self.gated else 2) * self.hidden * self.intermediate
        return self.hidden * self.qkv_out + self.heads * self.head_dim * self.hidden + mlp

    def linears(self, tokens: int, b: int) -> Cost:
        """Q/K/V, output projection and the MLP over `tokens` tokens."""
        h, i = self.hidden, self.intermediate
        mlp = (linear(tokens, h, 2 * i, b) if self.gated else linear(tokens, h, i, b)) + linear(tokens, i, h, b)
        return linear(tokens, h, self.qkv_out, b) + linear(tokens, self.heads * self.head_dim, h, b) + mlp

    def forward(self, seqs: list[int], b: int, causal: bool = False) -> Cost:
        """One layer over independent sequences `seqs` (lengths), batched as one call."""
        att = attention(list(seqs), self.heads, self.head_dim, b, causal)
        c = self.linears(sum(seqs), b) + att
        return Cost(c.flops, c.bytes, 1, 2.0 * sum(seqs) * self.hidden * b, 2)

    def decode(self, contexts: list[int], b: int) -> Cost:
        """One layer of a decode step: one new token per sequence, attending to its context."""
        n = len(contexts)
        kv = float(sum(contexts)) * 2 * self.kv_heads * self.head_dim * b
        att = Cost(4.0 * sum(contexts) * self.heads * self.head_dim, kv)
        c = self.linears(n, b) + att
        return Cost(c.flops, c.bytes, 1, 2.0 * n * self.hidden * b, 2)
