"""Models shared by the benchmarks: the sizes the issue names (3.7M-parameter MLP, ~25M model)."""

from __future__ import annotations

import torch
from torch import nn

MODELS = {
    # 1024*2048 + 2048*768 + 768*10 weights (+ biases) = 3.68M parameters, as in the reference's measurement.
    "mlp3.7m": (1024, (2048, 768), 10),
    "mlp25m": (2048, (4096, 4096), 10),
    "mlp0.3m": (256, (512, 256), 10),  # benchmarks/diloco.py's small case
}


def build(name: str, seed: int = 0) -> nn.Module:
    """The named MLP, deterministically initialised."""
    d_in, hidden, d_out = MODELS[name]
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    prev = d_in
    for width in hidden:
        layers += [nn.Linear(prev, width), nn.ReLU()]
        prev = width
    layers.append(nn.Linear(prev, d_out))
    return nn.Sequential(*layers)


def batch(name: str, batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch for `step` (same on every run)."""
    d_in, _, d_out = MODELS[name]
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch_size, d_in, generator=gen), torch.randint(0, d_out, (batch_size,), generator=gen)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
