"""The RoPE-strategy interface and its registry.

To add a strategy, write one class in a new file of this package and a `conf/rope/<name>.yaml`:

    class Mine(RopeStrategy):
        name = "mine"                         # rope.strategy=mine; registered when the class is defined
        statistics = ("pair_norms",)          # calibration statistics it reads (mla/calibration.py);
                                              # `needs(score)` if they depend on the score option

        def select(self, shape, r, score, calibration):
            q_norms, k_norms = calibration.get("pair_norms")
            return [HeadPairs(...) for each layer]  # or RotatedPairs (mla/layouts.py)

Validation, the run name, calibration sampling and the aggregation ask this registry; nothing else changes.
"""

from __future__ import annotations

from typing import ClassVar

from ...registry import Registered, Registry
from ..layouts import HeadPairs

ROPE_STRATEGIES = Registry("RoPE strategy", "rope")


class RopeStrategy(Registered):
    """Chooses, per layer, which (rotated) frequency pairs keep RoPE: a list of `HeadPairs` or `RotatedPairs`."""

    registry = ROPE_STRATEGIES
    statistics: ClassVar[tuple[str, ...]] = ()  # what `select` reads from the calibration
    scores: ClassVar[tuple[str, ...]] = ("product",)  # the `score` values it understands (default first)
    # True: it ranks pairs for one rope key shared by the heads (`ranked`), so a layer can keep any number of
    # them, as a KV budget split between rope dims and latent asks (mla/budget.py)
    any_pair_count: ClassVar[bool] = False
    layout: ClassVar[str] = "per_head"  # the layout of its selections (mla/layouts.py): per_head | shared

    def needs(self, score: str) -> tuple[str, ...]:
        """The calibration statistics `select` reads under `score` (by default `statistics`)."""
        return self.statistics

    def default_r(self, head_dim: int) -> int:
        """r when a config leaves it null: the paper's d_h/16."""
        return head_dim // 16

    def resolve_r(self, r, head_dim: int) -> int:
        """Check `r` (pairs kept per KV head) for this strategy; ValueError naming it otherwise."""
        if r is None:
            raise ValueError(f"r is required for rope='{self.name}'")
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"r must be an integer, got {r!r}")
        if not 0 <= r <= head_dim // 2:
            raise ValueError(f"r={r} is outside [0, d_h/2] = [0, {head_dim // 2}] for head_dim={head_dim}")
        return r

    def label(self, r: int, score: str) -> str:
        """This strategy's part of a run name."""
        return f"{self.name}-r{r}" + ("" if score == self.scores[0] else f"-{score}")

    def select(self, shape, r: int, score: str, calibration) -> list:
        raise NotImplementedError


class FixedPairs(RopeStrategy):
    """A data-free strategy: the same pairs for every layer and KV head."""

    def pairs(self, r: int, head_dim: int) -> list[int]:
        raise NotImplementedError

    def select(self, shape, r, score, calibration):
        kept = self.pairs(r, shape.head_dim)
        return [HeadPairs([list(kept) for _ in range(shape.num_kv_heads)]) for _ in range(shape.num_layers)]
