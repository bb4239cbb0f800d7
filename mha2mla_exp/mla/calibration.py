"""Calibration statistics: what RoPE strategies and low-rank inits read from the source model's activations.

A `Statistic` hooks the attention layers and accumulates over the calibration batches; one forward pass
over the batches serves every statistic a conversion asks for (`Calibration.prefetch`). Named statistics
register themselves (mha2mla_exp/registry.py), so a strategy declares `statistics = ("pair_norms", ...)`; a
strategy may also bring its own unnamed one and run it with `Calibration.run` (RoRoPE's rotated-key norms need
its rotation first).
Statistics read the family's own pre-RoPE queries and keys, after its QK-norm (`SourceAttention`,
mla/families.py), from the attention layers' inputs: each hook is a forward pre-hook of the attention module.
Every result is on the CPU: pair norms in float32, moments in float64 as means per token.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..registry import Registered, Registry
from .families import SourceAttention, source_attentions, visible_keys

STATISTICS = Registry("calibration statistic", "statistics")


def on_inputs(layers: list[SourceAttention], fn) -> list:
    """Forward pre-hooks calling fn(i, layer, x, kwargs) with each attention layer's input x [B, T, d]."""

    def hook(i, layer):
        def pre(module, args, kwargs):
            fn(i, layer, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0], kwargs)

        return pre

    return [layer.module.register_forward_pre_hook(hook(i, layer), with_kwargs=True) for i, layer in enumerate(layers)]


class Statistic(Registered):
    """Accumulates one statistic of every layer; `attach` registers hooks, `result` reads it out. A named one is
    registered for `statistics = (name, ...)`; an unnamed one is run by its strategy (`Calibration.run`)."""

    registry = STATISTICS

    def __init__(self, shape):
        self.shape = shape

    def attach(self, layers: list[SourceAttention]) -> list:
        raise NotImplementedError

    def result(self, n_seqs: int, n_tokens: int):
        raise NotImplementedError


def _heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    return x.float().view(*x.shape[:-1], heads, head_dim)  # [B, T, heads, d_h]


class PairNorms(Statistic):
    """Mean pre-RoPE pair norms of queries [L, n_h, d_h/2] and keys [L, n_kv, d_h/2] (bias included):
    averaged over the tokens of each sequence, then over sequences (the paper's 2-norm statistic)."""

    name = "pair_norms"

    def __init__(self, shape):
        super().__init__(shape)
        half = shape.head_dim // 2
        self.q = torch.zeros(shape.num_layers, shape.num_heads, half, dtype=torch.float64)
        self.k = torch.zeros(shape.num_layers, shape.num_kv_heads, half, dtype=torch.float64)

    def attach(self, layers):
        d_h, half = self.shape.head_dim, self.shape.head_dim // 2

        def add(total, out, heads):
            x = _heads(out, heads, d_h)
            norms = torch.sqrt(x[..., :half] ** 2 + x[..., half:] ** 2)  # [B, T, heads, half]
            total.add_(norms.mean(dim=1).sum(dim=0).double().cpu())

        def fn(i, layer, x, kwargs):
            add(self.q[i], layer.queries(x), self.shape.num_heads)
            add(self.k[i], layer.keys(x), self.shape.num_kv_heads)

        return on_inputs(layers, fn)

    def result(self, n_seqs, n_tokens):
        return (self.q / n_seqs).float(), (self.k / n_seqs).float()


class KeyPairMoments(Statistic):
    """Per layer and frequency f, the n_kv x n_kv second moment of the pre-RoPE keys across KV heads,
    real and imaginary halves pooled: mean over tokens of k_re k_re^T + k_im k_im^T. [L, d_h/2, n_kv, n_kv]."""

    name = "key_pair_moments"

    def __init__(self, shape):
        super().__init__(shape)
        n_kv, half = shape.num_kv_heads, shape.head_dim // 2
        self.total = torch.zeros(shape.num_layers, half, n_kv, n_kv, dtype=torch.float64)

    def attach(self, layers):
        d_h, half = self.shape.head_dim, self.shape.head_dim // 2

        def fn(i, layer, x, kwargs):
            k = _heads(layer.keys(x), self.shape.num_kv_heads, d_h).double()
            re, im = k[..., :half], k[..., half:]
            self.total[i].add_((torch.einsum("btgf,bthf->fgh", re, re) + torch.einsum("btgf,bthf->fgh", im, im)).cpu())

        return on_inputs(layers, fn)

    def result(self, n_seqs, n_tokens):
        return self.total / n_tokens


class InputGram(Statistic):
    """Per layer, the mean X^T X of the attention projections' input (the normed hidden states). [L, d, d]"""

    name = "input_gram"

    def __init__(self, shape):
        super().__init__(shape)
        d = shape.hidden_size
        self.total = torch.zeros(shape.num_layers, d, d, dtype=torch.float64)

    def attach(self, layers):
        def fn(i, layer, x, kwargs):
            x = x.reshape(-1, x.shape[-1]).double()
            self.total[i].add_((x.T @ x).cpu())

        return on_inputs(layers, fn)

    def result(self, n_seqs, n_tokens):
        return self.total / n_tokens


class QueryMoments(Statistic):
    """Per layer and query head, the mean q q^T of the pre-RoPE query (bias included): what a NoPE key
    error is seen through. [L, n_h, d_h, d_h]"""

    name = "query_moments"

    def __init__(self, shape):
        super().__init__(shape)
        n_h, d_h = shape.num_heads, shape.head_dim
        self.total = torch.zeros(shape.num_layers, n_h, d_h, d_h, dtype=torch.float64)

    def attach(self, layers):
        def fn(i, layer, x, kwargs):
            q = _heads(layer.queries(x), self.shape.num_heads, self.shape.head_dim).double()
            self.total[i].add_(torch.einsum("bthi,bthj->hij", q, q).cpu())

        return on_inputs(layers, fn)

    def result(self, n_seqs, n_tokens):
        return self.total / n_tokens


def attention_probs(layer: SourceAttention, shape, x: torch.Tensor, kwargs) -> torch.Tensor:
    """An attention layer's own causal probabilities [B, n_h, T, T] (its scale and soft cap), recomputed from
    its input x (calibration rows are unpadded), within its sliding window."""
    n_h, n_kv, d_h = shape.num_heads, shape.num_kv_heads, shape.head_dim
    cos, sin = kwargs["position_embeddings"]
    b, t, _ = x.shape
    q, k = (p.view(b, t, -1, d_h).transpose(1, 2).float() for p in (layer.queries(x), layer.keys(x)))
    q, k = apply_rotary_pos_emb(q, k, cos.float(), sin.float())
    scores = (q @ k.repeat_interleave(n_h // n_kv, dim=1).transpose(-1, -2)) * layer.scaling
    if layer.softcap is not None:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    visible = visible_keys(t, layer.sliding_window, x.device)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


class ValueSpread(Statistic):
    """Per layer and query head h, tau_h = mean over queries t of sum_s p_ts ||W_o,h (v_s - o_t)||^2: how
    far, through the output projection, the values a query attends to lie from its output o_t = sum_s p_ts v_s.
    A score error d at key s moves the head's output by p_s (d_s - mean_p d) (v_s - o_t), so tau_h turns a
    score error into an output error. [L, n_h]"""

    name = "value_spread"

    def __init__(self, shape):
        super().__init__(shape)
        self.total = torch.zeros(shape.num_layers, shape.num_heads, dtype=torch.float64)

    def attach(self, layers):
        n_h, n_kv, d_h = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim

        def fn(i, layer, x, kwargs):
            p = attention_probs(layer, self.shape, x, kwargs)
            v = layer.values(x).view(*x.shape[:2], n_kv, d_h)
            v = v.transpose(1, 2).float().repeat_interleave(n_h // n_kv, dim=1)
            w_o = layer.o_proj.weight.float().view(-1, n_h, d_h).transpose(0, 1)  # [n_h, d, d_h]
            metric = w_o.transpose(1, 2) @ w_o  # [n_h, d_h, d_h] = W_o,h^T W_o,h
            v_norm = torch.einsum("bhsi,hij,bhsj->bhs", v, metric, v)
            o = p @ v
            o_norm = torch.einsum("bhti,hij,bhtj->bht", o, metric, o)
            spread = (p @ v_norm.unsqueeze(-1)).squeeze(-1) - o_norm  # [B, n_h, T]
            self.total[i].add_(spread.sum(dim=(0, 2)).double().cpu())

        return on_inputs(layers, fn)

    def result(self, n_seqs, n_tokens):
        return self.total / n_tokens


class AttendedPairStatistic(Statistic):
    """Per layer, query head h and frequency f: the mean over queries t of sum_s p_ts g_f(t, s), p the
    layer's own causal attention, g a function of pair f's rotation at the two positions (`attended`), read
    from the model's own cos/sin (any RoPE scaling included). [L, n_h, d_h/2]"""

    def __init__(self, shape):
        super().__init__(shape)
        self.total = torch.zeros(shape.num_layers, shape.num_heads, shape.head_dim // 2, dtype=torch.float64)

    def attended(self, p: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """sum over batch, t and s of p [B, n_h, T, T] times g(t, s); cos/sin [T, d_h/2] -> [n_h, d_h/2]."""
        raise NotImplementedError

    def attach(self, layers):
        half = self.shape.head_dim // 2

        def fn(i, layer, x, kwargs):
            p = attention_probs(layer, self.shape, x, kwargs)
            cos, sin = (c[0, :, :half].float() for c in kwargs["position_embeddings"])  # [T, half]
            self.total[i].add_(self.attended(p, cos, sin).double().cpu())

        return on_inputs(layers, fn)

    def result(self, n_seqs, n_tokens):
        return (self.total / n_tokens).float()


class RotationDistance(AttendedPairStatistic):
    """rho_{h,f}, g = |e^{i theta_f t} - e^{i theta_f s}|: how far the rotation of pair f moves over the
    distances the head actually attends. Dropping RoPE on pair f changes its score term
    Re(q k* e^{i theta_f (t-s)}) by at most |q||k| times that: a pair whose frequency barely turns within the
    attended span is NoPE already."""

    name = "rotation_distance"

    def attended(self, p, cos, sin):
        distance = torch.sqrt((cos[:, None] - cos[None]) ** 2 + (sin[:, None] - sin[None]) ** 2)
        return torch.einsum("bhts,tsf->hf", p, distance)


class AttendedCosine(AttendedPairStatistic):
    """c_{h,f}, g = cos(theta_f (t-s)): the attention-weighted mean of how pair f's rotation turns a score term
    Re(q k* e^{i theta_f (t-s)}). A pair that loses RoPE scores q.k as at distance 0; scaling its key by c makes
    that term's mean over the attended distances right instead (`nope_keys='attended'`, mla/nope_keys.py)."""

    name = "attended_cosine"

    def attended(self, p, cos, sin):  # cos(a - b) = cos a cos b + sin a sin b
        return torch.einsum("bhts,tf,sf->hf", p, cos, cos) + torch.einsum("bhts,tf,sf->hf", p, sin, sin)


class AttentionInputs(Statistic):
    """The attention layers' inputs (the normed hidden states) for the first calibration batches, up to
    `max_tokens` tokens, with each batch's cos/sin: what a converted layer is measured on against the
    full-rank one. (per layer: a list of [B, T, d] batches; per layer, the (cos, sin) of each batch, which
    differ between layers in families with per-layer rope bases)"""

    name = "attention_inputs"
    max_tokens = 8192

    def __init__(self, shape):
        super().__init__(shape)
        self.inputs = [[] for _ in range(shape.num_layers)]
        self.rotary: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(shape.num_layers)]

    def attach(self, layers):
        def fn(i, layer, x, kwargs):
            if sum(b.shape[0] * b.shape[1] for b in self.inputs[i]) >= self.max_tokens:
                return
            self.inputs[i].append(x.detach().float().cpu())
            self.rotary[i].append(tuple(c.detach().float().cpu() for c in kwargs["position_embeddings"]))

        return on_inputs(layers, fn)

    def result(self, n_seqs, n_tokens):
        return self.inputs, self.rotary


class Calibration:
    """The calibration batches of one conversion and the statistics read from them (each collected once)."""

    def __init__(self, model: nn.Module, batches: Iterable | None, shape):
        self.model, self.shape = model, shape
        self.batches = None if batches is None else list(batches)
        self._results: dict[str, object] = {}

    def prefetch(self, names: Iterable[str]) -> None:
        """Collect every named statistic not collected yet, in one pass."""
        missing = [n for n in dict.fromkeys(names) if n not in self._results]
        unknown = [n for n in missing if n not in STATISTICS]
        if unknown:
            raise ValueError(f"unknown calibration statistic(s) {unknown}; known: {sorted(STATISTICS)}")
        if missing:
            results = self.run(*(STATISTICS.build(n, self.shape) for n in missing))
            self._results.update(zip(missing, results))

    def get(self, name: str):
        self.prefetch([name])
        return self._results[name]

    @torch.no_grad()
    def run(self, *statistics: Statistic) -> list:
        """One forward pass over the batches with every statistic's hooks; their results, in order."""
        if self.batches is None:
            raise ValueError("this conversion needs calibration data (an iterable of input_ids batches)")
        layers = source_attentions(self.model, self.shape)
        device = next(self.model.parameters()).device
        hooks = [h for s in statistics for h in s.attach(layers)]
        was_training = self.model.training
        self.model.eval()
        n_seqs = n_tokens = 0
        try:
            for batch in self.batches:
                ids = torch.as_tensor(batch["input_ids"] if isinstance(batch, dict) else batch)
                ids = ids if ids.dim() == 2 else ids[None]
                # the statistics read attention inputs only: one position's logits, not [B, T, vocab]
                self.model(input_ids=ids.to(device), use_cache=False, logits_to_keep=1)
                n_seqs, n_tokens = n_seqs + ids.shape[0], n_tokens + ids.numel()
        finally:
            for h in hooks:
                h.remove()
            self.model.train(was_training)
        if n_seqs == 0:
            raise ValueError("the calibration iterable is empty")
        return [s.result(n_seqs, n_tokens) for s in statistics]
