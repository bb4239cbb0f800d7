"""The two ways a layer's keys can keep RoPE, and the query/key weights each one gives.

A RoPE strategy returns, per layer, one of these selections; the conversion asks it for a `KeySplit`.

- `HeadPairs` (layout 'per_head', MHA2MLA): each KV head keeps RoPE on its own r frequency pairs; its rope
  key (2r dims) is read by the query heads of its group. q rows are permuted so that each head's kept dims
  come first; the NoPE keys are the other d_h-2r dims of each head.
- `RotatedPairs` (layout 'shared', RoRoPE / DeepSeek): per frequency f an orthogonal n_kv x n_kv matrix
  U_f mixes the KV heads (the same on the real and imaginary halves, so it commutes with RoPE and leaves
  every score unchanged): k'_{c,f} = sum_g U_f[g, c] k_{g,f}. RoPE is kept on n_kv*r rotated (component,
  frequency) pairs, one rope key of 2*n_kv*r dims read by every query head; query head h of group g meets
  pair (c, f) with U_f[g, c] * q_{h,f}. The dropped pairs become NoPE: head h scores q_h . P k_g, where
  P k_g is KV head g's key projected on the dropped subspace (d_h dims per head, total rank n_kv*(d_h-2r),
  stored compactly as the dropped rotated coordinates and re-embedded by `nope_embed`).

Pairs follow the rotate_half layout: pair f is dims (f, f + d_h/2), f = 0 the highest frequency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PER_HEAD, SHARED = "per_head", "shared"


@dataclass
class KeySplit:
    """One layer's query and key weights arranged for MLA (they may alias the source's tensors; the
    conversion copies what it keeps).

    `nope_weight` [m, d] (+ `nope_bias`) are the compact NoPE key coordinates that the low-rank step
    factorises (m = n_kv*(d_h-2r), their rank); the NoPE keys the heads meet are `nope_embed @ compact`
    ([n_kv*nope_dim, m]; None = the identity), multiplied by each query head's dims `nope_query_index[g]`.
    """

    layout: str
    pairs: list[list[int]]  # config.rope_pairs[layer]: kept frequency pairs per rope-key head
    q_weight: torch.Tensor
    q_bias: torch.Tensor | None
    rope_weight: torch.Tensor  # k_rope_proj rows: rope key heads x [kept dims, their partners]
    rope_bias: torch.Tensor | None
    nope_weight: torch.Tensor
    nope_bias: torch.Tensor | None
    nope_embed: torch.Tensor | None
    nope_query_index: torch.Tensor  # [n_kv, nope_dim]
    q_rope_scale: torch.Tensor | None = None  # shared layout: [n_h, n_kv*r], U_f[g(h), c] per kept pair
    q_rows: torch.Tensor | None = None  # [n_h, d_h]: the source's query dims in q_weight's row order (None: as is)

    @property
    def nope_dim(self) -> int:
        return self.nope_query_index.shape[1]


def rope_dims(pairs: list[int], head_dim: int) -> list[int]:
    """The dims of a rope key head: its kept pairs `f`, then their partners `f + d_h/2`."""
    return list(pairs) + [f + head_dim // 2 for f in pairs]


def _rows(linear: nn.Linear, heads: int, head_dim: int, index: torch.Tensor):
    """The output rows `index[h]` of each head h of `linear`, heads concatenated (weight, bias)."""
    head = torch.arange(heads)[:, None]
    w = linear.weight.view(heads, head_dim, -1)[head, index].reshape(-1, linear.in_features)
    b = None if linear.bias is None else linear.bias.view(heads, head_dim)[head, index].reshape(-1)
    return w, b


@dataclass(frozen=True)
class HeadPairs:
    """Layout 'per_head': `pairs[g]` are the sorted frequency pairs KV head g keeps."""

    pairs: list[list[int]]

    layout = PER_HEAD

    def _dims(self, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """Per KV head, its RoPE dims and its NoPE dims (the rows of the split's `nope_weight`), [n_kv, *]."""
        n_kv, d_h = shape.num_kv_heads, shape.head_dim
        rope = torch.tensor([rope_dims(p, d_h) for p in self.pairs], dtype=torch.long).view(n_kv, -1)
        nope = torch.tensor(
            [[i for i in range(d_h) if i not in set(dims)] for dims in rope.tolist()], dtype=torch.long
        ).view(n_kv, -1)
        return rope, nope

    def split(self, attn: nn.Module, shape) -> KeySplit:
        n_h, n_kv, d_h = shape.num_heads, shape.num_kv_heads, shape.head_dim
        rope, nope = self._dims(shape)
        perm = torch.cat([rope, nope], dim=1).repeat_interleave(n_h // n_kv, dim=0)  # RoPE dims first
        q_weight, q_bias = _rows(attn.q_proj, n_h, d_h, perm)
        rope_weight, rope_bias = _rows(attn.k_proj, n_kv, d_h, rope)
        nope_weight, nope_bias = _rows(attn.k_proj, n_kv, d_h, nope)
        return KeySplit(
            PER_HEAD,
            [list(p) for p in self.pairs],
            q_weight,
            q_bias,
            rope_weight,
            rope_bias,
            nope_weight,
            nope_bias,
            None,
            nope,
            q_rows=perm,
        )

    def nope_readers(self, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """For each row of the split's `nope_weight`: its frequency pair [m], and each query head's
        coefficient on it [m, n_h] (1 for the heads of its KV head's group)."""
        n_h, n_kv = shape.num_heads, shape.num_kv_heads
        _, nope = self._dims(shape)
        heads_of = torch.arange(n_kv).repeat_interleave(nope.shape[1])  # each row's KV head
        readers = (torch.arange(n_h)[None] // (n_h // n_kv) == heads_of[:, None]).double()
        return nope.reshape(-1) % (shape.head_dim // 2), readers


@dataclass(frozen=True)
class RotatedPairs:
    """Layout 'shared': `rotation[f]` is U_f (columns = components), `kept` the (component, frequency)
    pairs that keep RoPE, n_kv*r of them."""

    rotation: torch.Tensor  # [d_h/2, n_kv, n_kv], orthogonal per frequency
    kept: list[tuple[int, int]]

    layout = SHARED

    def split(self, attn: nn.Module, shape) -> KeySplit:
        n_h, n_kv, d_h = shape.num_heads, shape.num_kv_heads, shape.head_dim
        half, d = d_h // 2, shape.hidden_size
        u = self.rotation.double()
        kept = sorted(self.kept, key=lambda cf: (cf[1], cf[0]))
        dropped = self.dropped(shape)

        def rotate(w: torch.Tensor) -> torch.Tensor:  # [n_kv, d_h, ...] -> [n_kv (components), d_h, ...]
            re, im = w[:, :half].double(), w[:, half:].double()
            return torch.cat([torch.einsum("fgc,gf...->cf...", u, re), torch.einsum("fgc,gf...->cf...", u, im)], 1)

        def pick(w: torch.Tensor, pairs) -> torch.Tensor:  # real parts of `pairs`, then their imaginary parts
            c = torch.tensor([p[0] for p in pairs], dtype=torch.long)
            f = torch.tensor([p[1] for p in pairs], dtype=torch.long)
            return torch.cat([w[c, f], w[c, f + half]]).to(attn.k_proj.weight.dtype)

        k_rot = rotate(attn.k_proj.weight.view(n_kv, d_h, d))
        b_rot = None if attn.k_proj.bias is None else rotate(attn.k_proj.bias.view(n_kv, d_h))
        rope_bias = nope_bias = None
        if b_rot is not None:
            rope_bias, nope_bias = pick(b_rot, kept), pick(b_rot, dropped)

        m = len(dropped)
        nope_dim = d_h if m else 0
        embed = torch.zeros(n_kv * nope_dim, 2 * m, dtype=torch.float64)
        for j, (c, f) in enumerate(dropped):  # P k_g in the original basis, from the dropped coordinates
            for g in range(n_kv):
                embed[g * d_h + f, j] = embed[g * d_h + f + half, m + j] = u[f, g, c]
        group = torch.arange(n_h) // (n_h // n_kv)
        scale = torch.stack([u[f, group, c] for c, f in kept], dim=1) if kept else torch.zeros(n_h, 0)
        dtype = attn.k_proj.weight.dtype
        return KeySplit(
            SHARED,
            [[f for _, f in kept]],
            attn.q_proj.weight,
            attn.q_proj.bias,
            pick(k_rot, kept),
            rope_bias,
            pick(k_rot, dropped),
            nope_bias,
            embed.to(dtype),
            torch.arange(nope_dim).repeat(n_kv, 1),
            q_rope_scale=scale.to(dtype),
        )

    def dropped(self, shape) -> list[tuple[int, int]]:
        """The rotated (component, frequency) pairs that become NoPE, frequency-major: the order of the
        split's compact NoPE coordinates (real parts, then imaginary parts)."""
        kept = set(self.kept)
        return [(c, f) for f in range(shape.head_dim // 2) for c in range(shape.num_kv_heads) if (c, f) not in kept]

    def nope_readers(self, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """For each row of the split's `nope_weight`: its frequency pair [m], and each query head's
        coefficient on it [m, n_h] (U_f[g(h), c]: the rotated coordinate is read through the rotation)."""
        n_h, n_kv = shape.num_heads, shape.num_kv_heads
        dropped = self.dropped(shape) * 2  # the real and the imaginary coordinate of each pair
        group = torch.arange(n_h) // (n_h // n_kv)
        u = self.rotation.double()
        readers = torch.stack([u[f, group, c] for c, f in dropped]) if dropped else torch.zeros(0, n_h)
        return torch.tensor([f for _, f in dropped], dtype=torch.long), readers.double()
