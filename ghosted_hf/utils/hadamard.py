"""Orthonormal Hadamard matrices for the sizes of real models (C = 2^k * m, m from Paley constructions).

LinearPatch scales channels in a Hadamard-rotated basis, where outlier channels are spread out.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    residues = {(x * x) % q for x in range(1, q)}
    chi = [0] + [1 if a in residues else -1 for a in range(1, q)]
    return torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)


def _paley(m: int) -> torch.Tensor | None:
    """A +-1 Hadamard matrix of order m from Paley I (m = q + 1) or II (m = 2(q + 1)), q prime."""
    if m == 1:  # (2^k: Sylvester's doubling in `hadamard`)
        return torch.ones(1, 1, dtype=torch.float64)
    q = m - 1
    if _is_prime(q) and q % 4 == 3:
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return s + torch.eye(m, dtype=torch.float64)
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)
    return None


@lru_cache(maxsize=8)
def hadamard(n: int) -> torch.Tensor | None:
    """Orthonormal (H @ H.T = I) float64 Hadamard matrix of order n, or None if no construction here fits."""
    power = 1
    while n % power == 0:
        h = _paley(n // power)
        if h is not None:
            while h.shape[0] < n:
                h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
            return h / n**0.5
        power *= 2
    return None


def rotation(n: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """The Hadamard matrix of order n, or a seeded random orthogonal matrix where none is known."""
    h = hadamard(n)
    if h is not None:
        return h, "hadamard"
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)), f"random-orthogonal(seed={seed})"
