"""Shared test inputs for the attention tests: random Q/K/V shaped like the models' and the relative L2 error."""

import torch


def rel_l2(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def qkv(b=1, h=2, s=200, d=64, sk=None, dtype=torch.float32, k_bias=2.0, seed=0):
    """Random Q/K/V with a per-channel K bias, as real K has (SageAttention's reason to smooth K)."""
    g = torch.Generator().manual_seed(seed)
    sk = s if sk is None else sk
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, h, sk, d, generator=g) + k_bias * torch.randn(d, generator=g)
    v = torch.randn(b, h, sk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)
