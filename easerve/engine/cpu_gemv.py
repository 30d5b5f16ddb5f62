"""Weight layouts for the decode step's matrix-vector products on CPU.

A decode step at small batch is memory bound: every linear layer reads its whole weight for a
handful of rows. On CPU, `F.linear` with the weight stored [out, in] (nn.Linear's layout) does
not reach the core's read bandwidth for every shape: on this project's AVX2 machine, one
thread, a 1536x512 layer (an MLP's gate / up projection) takes 222 us at one row against 149 us
as `addmm(bias, x, W_t)` with the weight stored [in, out], while a 512x1536 one (down
projection) goes the other way (159 vs 225 us). Which layout wins depends on the shape and the
BLAS, so the engine measures: for each distinct (out, in, bias) shape among the language
model's linear layers it times both layouts at one row on the engine's own threads and keeps
the faster one (`choose`), then swaps the winners to `TransposedLinear` (`apply`), the same
arithmetic with the weight stored transposed. Tied weights (a linear sharing its parameter with
another module, e.g. an lm_head tied to the embeddings) are left as they are.

GPU engines do not call this: their GEMVs go through cuBLAS, whose layout choice is its own.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable

import torch
from torch import nn

Shape = tuple[int, int, bool]  # (out_features, in_features, has bias)
MIN_GAIN = 1.05  # swap only when the transposed layout is at least this much faster


class TransposedLinear(nn.Module):
    """nn.Linear with its weight stored [in, out]; `weight` is the [out, in] view of it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:  # what HF code reads for dtype / device
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = rows @ self.weight_t if self.bias is None else torch.addmm(self.bias, rows, self.weight_t)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def linears(root: nn.Module, extra: Iterable[tuple[nn.Module, str]] = ()) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every nn.Linear under `root`, and of the layers named by
    `extra` ((parent, attribute) pairs, e.g. the lm_head beside the decoder), whose weight no
    other module among them shares; each once."""
    pairs = [(parent, name) for _, parent in root.named_modules() for name, _ in parent.named_children()]
    pairs += list(extra)
    owners: dict[int, int] = {}
    for mod in {id(m): m for m in [*root.modules(), *(getattr(p, n) for p, n in extra)]}.values():
        for prm in mod.parameters(recurse=False):
            owners[id(prm)] = owners.get(id(prm), 0) + 1
    found, seen = [], set()
    for parent, name in pairs:
        child = getattr(parent, name)
        if type(child) is nn.Linear and id(child) not in seen and owners.get(id(child.weight)) == 1:
            seen.add(id(child))
            found.append((parent, name, child))
    return found


def shape_of(layer: nn.Linear) -> Shape:
    return layer.out_features, layer.in_features, layer.bias is not None


COLD_BYTES = 64 << 20  # weights cycled per timing: more than a CPU's last-level cache


def time_layouts(shape: Shape, dtype: torch.dtype, reps: int = 7) -> tuple[float, float]:
    """Median seconds of one row through (nn.Linear's layout, the transposed one) on random
    weights of `shape`, cycling through COLD_BYTES of copies as a decode step reads its layers
    from memory (one weight timed again and again sits in cache and hides the difference);
    the layouts interleave so load from elsewhere hits both alike."""
    out_f, in_f, bias = shape
    copies = max(2, min(256, COLD_BYTES // max(1, out_f * in_f * dtype.itemsize)))
    w0 = torch.randn(out_f, in_f, dtype=dtype)
    ws = [w0.clone() for _ in range(copies)]
    ws_t = [w.t().contiguous() for w in ws]
    b = torch.randn(out_f, dtype=dtype) if bias else None
    x = torch.randn(1, in_f, dtype=dtype)

    def plain() -> None:
        for w in ws:
            torch.nn.functional.linear(x, w, b)

    def moved() -> None:
        for w in ws_t:
            torch.addmm(b, x, w) if b is not None else x @ w
    a, t = [], []
    for i in range(reps + 1):
        for fn, acc in ((plain, a), (moved, t)) if i % 2 else ((moved, t), (plain, a)):
            t0 = time.perf_counter()
            fn()
            if i >= 1:  # the first round warms the BLAS
                acc.append((time.perf_counter() - t0) / copies)
    return statistics.median(a), statistics.median(t)


_measured: dict[tuple[Shape, torch.dtype, int], bool] = {}  # one process measures a shape once


def choose(shapes: Iterable[Shape], dtype: torch.dtype,
           timer: Callable[[Shape, torch.dtype], tuple[float, float]] | None = None) -> dict[Shape, bool]:
    """For each shape: True when the transposed layout is at least MIN_GAIN x faster. With the
    default timer a decision is remembered per (shape, dtype, torch threads) for the process."""
    out = {}
    for s in dict.fromkeys(shapes):
        key = (s, dtype, torch.get_num_threads())
        if timer is None and key in _measured:
            out[s] = _measured[key]
            continue
        plain, moved = (timer or time_layouts)(s, dtype)
        out[s] = moved * MIN_GAIN <= plain
        if timer is None:
            _measured[key] = out[s]
    return out


def apply(root: nn.Module, dtype: torch.dtype, extra: Iterable[tuple[nn.Module, str]] = (),
          timer: Callable[[Shape, torch.dtype], tuple[float, float]] | None = None) -> dict[Shape, bool]:
    """Swap the linear layers of `linears(root, extra)` whose shape measures faster
    transposed; returns the decision per shape (for the log)."""
    found = linears(root, extra)
    decision = choose((shape_of(layer) for _, _, layer in found), dtype, timer)
    for parent, name, layer in found:
        if decision[shape_of(layer)]:
            setattr(parent, name, TransposedLinear(layer))
    return decision
