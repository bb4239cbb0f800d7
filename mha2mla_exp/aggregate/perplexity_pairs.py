"""Held-out perplexity differences that say whether they are resolved: the CPU reproduction's verdicts.

Rows are configurations at a budget (`records.CONFIG_KEYS`, `BUDGET_KEYS`; seeds counted once) of the given
experiments, read together (a table's seed-1 repeats live in an experiment of their own). Two rows are compared
when they differ in exactly one thing (the RoPE strategy, or its r, or no/full RoPE against partial; the SVD,
or its width, or none against one; one conversion option; the recovery recipe, as a whole; the budget) and were
scored on the same held-out rows. For each such pair:

- B/A: the ratio of their perplexities, exp of the difference of their mean per-token NLL (each row's NLL
  averaged over the seeds both rows have first);
- its 95% interval: a paired percentile bootstrap that resamples held-out documents (a document's rows stay
  together, the same resampled documents for A and B), i.e. the uncertainty from which text was held out, not
  from training noise. Rows of one speech are not independent; records that do not say which document each row
  came from (none written before `eval.perplexity.rows`) fall back to resampling rows, and the table says which
  unit each interval resampled;
- per document, the ratio on that document's rows; per seed, the ratio of the runs with that seed (training
  noise, which two seeds only sample);
- verdict: "B lower" / "B higher" when the interval excludes 1 and every shared seed and every document agree
  in direction, else "not resolved". Records without per-row NLLs (older runs) get the ratio and no verdict.
Two rows are paired only when they scored the same held-out rows (the same row indices when both say).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .paired import BOOTSTRAP_SEED, N_BOOTSTRAP
from .records import BUDGET_KEYS, CONFIG_KEYS, options_from_label
from .render import row_label, strategy_name
from .tables import _missing, _text, seeds_once

# factor -> the row keys it spans; rows that differ in exactly one factor are compared
FACTORS = {
    "RoPE": ("method", "rope", "r"),
    "SVD": ("svd", "d_kv"),
    "options": ("options",),
    "recipe": ("objective", "trainable", "lr", "warmup", "distill_token_passes"),
    "precision": ("precision",),
    "budget": ("train_tokens",),
}
ROW = CONFIG_KEYS + BUDGET_KEYS  # a row: the table rows' keys without the eval sample (perplexity has its own)
SAME = tuple(k for k in ROW if k not in {k for keys in FACTORS.values() for k in keys})


def _rows(runs: pd.DataFrame, experiments) -> dict[tuple, list[dict]]:
    ok = (
        runs[(runs["status"] == "ok") & runs["experiment"].isin(list(experiments)) & runs["heldout_ppl"].notna()]
        if len(runs)
        else runs
    )
    return seeds_once(ok.sort_values("run_dir").to_dict("records"), ROW)


def _factor(a: dict, b: dict) -> str | None:
    """The one factor in which two rows differ, or None (none, or several, or a shared key differs)."""
    if any(_differs(a, b, k) for k in SAME):
        return None
    differ = [name for name, keys in FACTORS.items() if any(_differs(a, b, k) for k in keys)]
    return differ[0] if len(differ) == 1 and _one_change(differ[0], a, b) else None


def _one_change(factor: str, a: dict, b: dict) -> bool:
    """Whether two rows that differ only in `factor` differ in one thing: not another strategy at another r,
    another SVD at another width, or two conversion options at once. Switching a factor off (NoPE or full RoPE
    against r pairs, no SVD against an SVD at its width) is one change; a recipe is compared as a whole."""
    if factor == "RoPE":
        return not (_partial(a) and _partial(b) and _differs(a, b, "rope") and _differs(a, b, "r"))
    if factor == "SVD":
        return not (_low_rank(a) and _low_rank(b) and _differs(a, b, "svd") and _differs(a, b, "d_kv"))
    if factor == "options":
        options_a, options_b = _options(a), _options(b)
        return sum(options_a.get(k) != options_b.get(k) for k in options_a.keys() | options_b.keys()) == 1
    return True


def _differs(a: dict, b: dict, key: str) -> bool:
    return _text(a.get(key)) != _text(b.get(key))


def _partial(row: dict) -> bool:
    """Whether the row keeps some, not all, rotary pairs (r > 0)."""
    return not _missing(row.get("r")) and float(row["r"]) > 0


def _low_rank(row: dict) -> bool:
    return _text(row.get("svd")) not in ("", "none")


def _options(row: dict) -> dict[str, str]:
    return options_from_label(_text(row.get("options")))


@dataclass(frozen=True)
class HeldOutRows:
    """Per held-out row: NLL (nats/token, averaged over seeds), tokens, and the row's document when known."""

    nll: np.ndarray
    tokens: np.ndarray
    documents: np.ndarray | None = None
    index: tuple | None = None  # the rows' indices in the held-out split, when the record kept them

    def same_rows(self, other: "HeldOutRows") -> bool:
        if len(self.nll) != len(other.nll) or not np.array_equal(self.tokens, other.tokens):
            return False
        return self._indices() == other._indices()

    def _indices(self) -> tuple:
        # a record without indices predates the stratified sample: it scored the first rows
        return self.index if self.index is not None else tuple(range(len(self.nll)))


def held_out_rows(nll, tokens, documents=None, index=None) -> HeldOutRows | None:
    """One record's rows (lists as the record keeps them), or None when it kept none."""
    if not isinstance(nll, list) or not isinstance(tokens, list) or not nll or len(nll) != len(tokens):
        return None
    documents = np.asarray(documents) if isinstance(documents, list) and len(documents) == len(nll) else None
    return HeldOutRows(
        np.asarray(nll, dtype=float),
        np.asarray(tokens, dtype=float),
        documents,
        tuple(index) if isinstance(index, list) else None,
    )


def _row_nll(runs: list[dict]) -> HeldOutRows | None:
    """The rows of the runs (seeds) of one configuration, NLL averaged; None unless all kept the same rows."""
    each = [
        held_out_rows(
            r.get("heldout_row_nll"),
            r.get("heldout_row_tokens"),
            r.get("heldout_row_document"),
            r.get("heldout_row_index"),
        )
        for r in runs
    ]
    if any(x is None for x in each) or not all(each[0].same_rows(x) for x in each[1:]):
        return None
    return HeldOutRows(np.mean([x.nll for x in each], axis=0), each[0].tokens, each[0].documents, each[0].index)


def ratio_interval(
    a: HeldOutRows, b: HeldOutRows, *, n_boot: int = N_BOOTSTRAP, seed: int = BOOTSTRAP_SEED, level: float = 0.95
) -> tuple[float, float, float]:
    """B/A perplexity and its paired percentile bootstrap interval over the same held-out rows, resampling
    documents (their rows together) when `a` knows each row's document, else rows."""
    return _exp_mean_interval((b.nll - a.nll) * a.tokens, a, n_boot, seed, level)  # per row, summed NLL difference


def perplexity_interval(
    rows: HeldOutRows, *, n_boot: int = N_BOOTSTRAP, seed: int = BOOTSTRAP_SEED, level: float = 0.95
) -> tuple[float, float, float]:
    """One configuration's held-out perplexity and its percentile bootstrap interval over the held-out documents
    (rows when their documents are unknown): which text was held out, not training noise."""
    return _exp_mean_interval(rows.nll * rows.tokens, rows, n_boot, seed, level)


def _exp_mean_interval(summed: np.ndarray, rows: HeldOutRows, n_boot: int, seed: int, level: float):
    """exp(sum(summed) / tokens) and its bootstrap interval, resampling `rows`' documents (their rows together)."""
    estimate = float(np.exp(summed.sum() / rows.tokens.sum()))
    groups = rows.documents if rows.documents is not None else np.arange(len(summed))
    keys, inverse = np.unique(groups, return_inverse=True)
    summed_g, tokens_g = np.bincount(inverse, summed), np.bincount(inverse, rows.tokens)
    idx = np.random.default_rng(seed).integers(0, len(keys), size=(n_boot, len(keys)))
    boot = np.exp(summed_g[idx].sum(1) / tokens_g[idx].sum(1))
    tail = 100 * (1 - level) / 2
    return estimate, float(np.percentile(boot, tail)), float(np.percentile(boot, 100 - tail))


def resampling_unit(rows: HeldOutRows) -> str:
    n = len(np.unique(rows.documents)) if rows.documents is not None else len(rows.nll)
    return f"{n} documents" if rows.documents is not None else f"{n} rows (documents unknown)"


def per_document_ratios(a: HeldOutRows, b: HeldOutRows) -> tuple[float, ...]:
    """B/A on each document's rows (in the order documents first appear); empty when documents are unknown."""
    if a.documents is None:
        return ()
    out = []
    for doc in dict.fromkeys(a.documents.tolist()):
        rows = a.documents == doc
        out.append(float(np.exp(((b.nll - a.nll) * a.tokens)[rows].sum() / a.tokens[rows].sum())))
    return tuple(out)


def _one_direction(ratios) -> bool:
    return all(x < 1 for x in ratios) or all(x > 1 for x in ratios)


def _ppl(runs: list[dict]) -> float:
    return float(np.exp(np.mean(np.log([r["heldout_ppl"] for r in runs]))))


def _label(run: dict) -> str:
    return f"{row_label(run)} @ {int(run.get('train_tokens') or 0):,} tokens"


FACTOR_QUESTIONS = {
    "SVD": "SVD variants: joint against split, and d_kv",
    "options": "conversion options",
    "recipe": "recovery recipes",
    "precision": "training precision",
    "budget": "fine-tune budget",
}


def pair_question(factor: str, a: dict, b: dict) -> str:
    """The question a pair answers, for splitting a forest plot: RoPE pairs by what they vary, with or without SVD."""
    if factor != "RoPE":
        return FACTOR_QUESTIONS[factor]
    if _partial(a) and _partial(b):
        question = "strategy against strategy at equal r" if _differs(a, b, "rope") else "r against r, one strategy"
    else:
        question = "partial RoPE against full RoPE or NoPE"
    return question + (", with SVD" if _low_rank(a) or _low_rank(b) else ", without SVD")


def perplexity_pairs(runs: pd.DataFrame, experiments) -> pd.DataFrame:
    """Every pair of rows of `experiments` that differ in one factor, B/A with its interval and verdict."""
    rows = _rows(runs, experiments)
    records = []
    for a, b in itertools.combinations(sorted(rows.values(), key=lambda g: _label(g[0])), 2):
        factor = _factor(a[0], b[0])
        if factor is None:
            continue
        by_seed_a, by_seed_b = ({_text(r.get("seed")): r for r in g} for g in (a, b))
        shared = sorted(set(by_seed_a) & set(by_seed_b))
        per_seed = [by_seed_b[s]["heldout_ppl"] / by_seed_a[s]["heldout_ppl"] for s in shared]
        if shared:  # the same data orders on both sides: a seed only one row has is left out of the ratio
            a, b = [by_seed_a[s] for s in shared], [by_seed_b[s] for s in shared]
        rows_a, rows_b = _row_nll(a), _row_nll(b)
        comparable = rows_a is not None and rows_b is not None and rows_a.same_rows(rows_b)
        estimate, low, high = ratio_interval(rows_a, rows_b) if comparable else (_ppl(b) / _ppl(a), np.nan, np.nan)
        per_document = per_document_ratios(rows_a, rows_b) if comparable else ()
        agree = len(per_seed) > 0 and _one_direction(per_seed) and (not per_document or _one_direction(per_document))
        if rows_a is None or rows_b is None:
            verdict = "no interval (per-row NLL not kept, or its seeds scored other rows)"
        elif not comparable:
            verdict = "not comparable: other held-out rows"  # B/A is then a ratio of two samples' means
        elif (high < 1 or low > 1) and agree:
            verdict = "B lower" if estimate < 1 else "B higher"
        else:
            verdict = "not resolved"
        records.append(
            {
                "question": pair_question(factor, a[0], b[0]),
                "factor": factor,
                "A": _label(a[0]),
                "B": _label(b[0]),
                "seeds": ",".join(shared) or f"A {len(a)}, B {len(b)} (none shared)",
                "ppl A": _ppl(a),
                "ppl B": _ppl(b),
                "B/A": estimate,
                "B/A low": low,
                "B/A high": high,
                "B/A per seed": tuple(per_seed),
                "B/A per document": per_document,
                "held-out rows": len(rows_a.nll) if comparable else None,
                "resampled": resampling_unit(rows_a) if comparable else "",
                "verdict": verdict,
            }
        )
    return pd.DataFrame.from_records(records)


PERPLEXITY_COLUMNS = (
    "experiment",
    "label",
    "train_tokens",
    "precision",
    "distill_token_passes",
    "convert_s",
    "distill_s",
    "train_s",
    "kv_mem_change_pct",
    "heldout_ppl",
)


def perplexity_view(runs: pd.DataFrame) -> pd.DataFrame:
    """Every ok run with its held-out perplexity and the compute it took, grouped by experiment. Rows are ordered
    by what they show (experiment, label, then the numbers), never by run folder names, which may change."""
    ok = runs[runs["status"] == "ok"] if len(runs) else runs
    columns = [c for c in PERPLEXITY_COLUMNS if c in runs.columns]
    return ok.loc[:, columns].sort_values(columns, kind="stable").reset_index(drop=True)


STRATEGY_COLUMNS = ["strategy", "train_tokens", "ppl", "low", "high", "seeds"]


def strategy_perplexities(runs: pd.DataFrame, model: str) -> pd.DataFrame:
    """Table 3's strategies by held-out perplexity, per fine-tune budget: one row per strategy (`strategy_name`) at
    r = d_h/16 (SVD at d_kv = d_h/4), and the full-attention fine-tune, with a bootstrap 95 % interval over the
    held-out documents (seeds' NLLs averaged). Where a strategy ran with several option sets, the options most of
    its kind (with or without SVD) used at that budget stand for it."""
    if not len(runs):
        return pd.DataFrame(columns=STRATEGY_COLUMNS)
    ok = runs[(runs["status"] == "ok") & (runs["model"] == model) & runs["heldout_ppl"].notna()]
    head = pd.to_numeric(ok["head_dim"], errors="coerce")
    paper_r = (ok["r"] == head // 16) | (ok["rope"] == "none")
    paper_svd = (ok["svd"] == "none") | (ok["d_kv"] == head // 4)
    kept = ok[
        (ok["method"] == "finetuned_full_attention")
        | (
            ok["method"].isin(["partial_rope", "partial_rope+svd"])
            & paper_r.fillna(False)
            & paper_svd.fillna(False)
            & ok["kv_elements"].isna()
        )
    ]
    groups = list(seeds_once(kept.sort_values("run_dir").to_dict("records"), ROW).values())
    usual = {}  # (budget, with SVD) -> the options most rows used
    for group in groups:
        usual.setdefault((_text(group[0]["train_tokens"]), _low_rank(group[0])), []).append(_text(group[0]["options"]))
    records = []
    for group in groups:
        first = group[0]
        options = usual[(_text(first["train_tokens"]), _low_rank(first))]
        if first["method"] != "finetuned_full_attention" and _text(first["options"]) != max(
            sorted(set(options)), key=options.count
        ):
            continue
        rows = _row_nll(group)
        estimate, low, high = perplexity_interval(rows) if rows is not None else (_ppl(group), np.nan, np.nan)
        records.append(
            {
                "strategy": strategy_name(first),
                "train_tokens": int(first["train_tokens"] or 0),
                "ppl": estimate,
                "low": low,
                "high": high,
                "seeds": len(group),
            }
        )
    frame = pd.DataFrame.from_records(records, columns=STRATEGY_COLUMNS)
    # several settings of one strategy at one budget (another lr, say): the one with most seeds
    return (
        frame.sort_values(["seeds", "strategy"], ascending=[False, True])
        .drop_duplicates(["strategy", "train_tokens"])
        .reset_index(drop=True)
    )
