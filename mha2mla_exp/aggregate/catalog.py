"""Every table and plot the aggregate writes, each declared once: its name, the experiments it reads, its kind
(the builder, `kinds`) and its caption. Registered on import, written in this order.

A new paper table is one experiment file (conf/experiment/<name>.yaml) and one `register(...)` here, e.g.

    register(Pairwise(name="my_study", experiments=("my_study",),
                      caption="Experiment my_study: every pair of its rows on the same docs"))

`experiments` are the `experiment` values recorded in results.json (None: every run); an entry is handed only
those runs.
"""

from __future__ import annotations

from . import plots
from .kinds import (
    DtypeCheck,
    Pairwise,
    PaperTable,
    PerplexityPairs,
    PerplexityView,
    Plot,
    RecoveryCurves,
    RecoveryStudy,
    ReferenceConverter,
    ZeroShot,
)
from .records import LONGBENCH
from .table_registry import FigureSpec, register
from .tables import TableSpec, select_table1, select_table2, select_table3, select_table5

TEACHER_RECOVERY_GOAL = -2.0  # issue 23: Avg points against the original, a dashed line on its plots

BASELINE_NOTE = (
    "Baseline (column vs): a converted model against the full-attention model fine-tuned on the same "
    "tokens (the original when neither was fine-tuned); the full-attention fine-tune against the "
    "original. "
)

# ------------------------------------------------------------------ the paper's tables, our rows beside its rows
register(
    PaperTable(
        name="table1",
        caption="Table 1: commonsense reasoning, original / full-attention FT / MLA at three d_kv",
        note="MLA rows: 2-norm partial RoPE, r = d_h/16, joint SVD. " + BASELINE_NOTE,
        spec=TableSpec("commonsense", select_table1, "avg", paper_table=1, with_kv_memory=True),
        plot=FigureSpec(
            "kv_memory_vs_avg",
            "What does each KV-cache saving cost in commonsense points, ours against the paper? Per fine-tune budget "
            "of ours: Avg (95 % interval) against KV memory, the paper's 2.25B-token points as the reference.",
            lambda table, inputs: plots.kv_memory_vs_avg(table, runs=inputs.runs),
        ),
    )
)
register(
    PaperTable(
        name="table2",
        caption="Table 2: long context by KV-cache precision",
        note="Ours: passkey retrieval (offline long-context suite; LongBench Avg beside where a run has it), the "
        "paper's: LongBench. Every row against the same model family's original with an unquantized cache. KV "
        "bytes are measured (residual full-precision tokens and quantization scales included); the paper's KV "
        "memory is nominal, against a BF16 cache.",
        spec=TableSpec(
            "long_context",
            select_table2,
            "longbench.avg",
            LONGBENCH,
            paper_table=2,
            by_precision=True,
            with_kv_memory=True,
            extras={"longbench.avg": "longbench_avg"},
        ),
    )
)
register(
    PaperTable(
        name="table3",
        caption="Table 3: partial-RoPE strategies, without and with SVD (joint vs split)",
        note="r = d_h/16; SVD rows at d_kv = d_h/4. " + BASELINE_NOTE,
        spec=TableSpec("commonsense", select_table3, "avg", paper_table=3),
        plot=FigureSpec(
            "strategy_comparison",
            "Which partial-RoPE strategy keeps most, with and without SVD? Table 3's bars, ours beside the paper's "
            '(commonsense Avg, 95 % intervals; "not run" where we have no commonsense run), and the same '
            "strategies by held-out perplexity.",
            lambda table, inputs: plots.strategy_comparison(table, inputs.runs),
        ),
    )
)
register(
    PaperTable(
        name="table5",
        caption="Table 5: partial-RoPE strategies by r",
        note="No SVD. The full row (r = d_h/2) is the fine-tuned full-attention model. " + BASELINE_NOTE,
        spec=TableSpec("commonsense", select_table5, "avg", paper_table=5),
    )
)

# ------------------------------------------------------------------ plots over every run
register(
    Plot(
        name="loss_curves",
        figure=FigureSpec(
            "loss_curves",
            "Did each study's fine-tunes converge, and which configurations train to a lower loss? One panel per "
            "experiment (split by its question), smoothed, the raw curve faint behind.",
            lambda inputs: plots.loss_curves(inputs.curves, inputs.runs),
        ),
    )
)
register(
    Plot(
        name="long_context_vs_length",
        figure=FigureSpec(
            "long_context_vs_length",
            "How does retrieval hold up as the context grows, per KV-cache precision (Table 2)?",
            lambda inputs: plots.long_context_vs_length(inputs.runs),
        ),
    )
)
RECOVERY_CURVES_QUESTION = (
    "Experiment {}: how fast does each recovery recipe bring a conversion back, against wall seconds and tokens?"
)
for _name, _experiment in (
    ("recovery_curves", "recovery"),
    ("recovery_study_curves", "recovery_study"),
    ("teacher_recovery_curves", "teacher_recovery"),
):
    register(
        RecoveryCurves(name=_name, experiments=(_experiment,), question=RECOVERY_CURVES_QUESTION.format(_experiment))
    )

# ------------------------------------------------------------------ every pair of one experiment's rows
register(
    Pairwise(
        name="headline",
        experiments=("headline",),
        caption="Experiment headline: every pair of its rows on the same docs",
    )
)
register(
    Pairwise(
        name="recovery",
        experiments=("recovery",),
        caption="Experiment recovery: every pair of its rows on the same docs",
    )
)
register(
    Pairwise(
        name="cpu10x_table1",
        experiments=("cpu10x_table1",),
        caption="Experiment cpu10x_table1: every pair of its rows on the same docs",
    )
)
register(
    Pairwise(
        name="passkey_nope",
        experiments=("passkey_nope",),
        suite="long_context",
        caption="Experiment passkey_nope: every pair of its rows on the same docs",
    )
)
register(
    Pairwise(
        name="teacher_recovery_pairs",
        experiments=("teacher_recovery",),
        caption="Experiment teacher_recovery: every pair of its rows on the same docs",
        against="original",
        goal=TEACHER_RECOVERY_GOAL,
    )
)

# ------------------------------------------------------------------ conversions without fine-tuning
register(
    ZeroShot(
        name="rorope_zero_shot",
        experiments=("rorope_zero_shot",),
        caption="Experiment rorope_zero_shot: conversions without fine-tuning at equal KV bytes",
    )
)
register(
    ZeroShot(
        name="budget_zero_shot",
        experiments=("budget_zero_shot",),
        caption="Experiment budget_zero_shot: conversions without fine-tuning at equal KV bytes",
    )
)
register(
    ZeroShot(
        name="gemma3_zero_shot",
        experiments=("gemma3_zero_shot",),
        caption="Experiment gemma3_zero_shot: the paper's grid on the real Gemma-3 270M, without fine-tuning",
    )
)
register(
    PerplexityPairs(
        name="gemma3_zero_shot_pairs",
        experiments=("gemma3_zero_shot",),
        caption="Held-out perplexity of the real Gemma-3 270M without fine-tuning, every pair of rows of "
        "gemma3_zero_shot that differs in one factor",
        question="Without fine-tuning, which of two conversions of Gemma-3 270M that differ in one thing fits "
        "held-out text better? One panel per question: strategy against strategy, SVD variants, widths.",
    )
)
register(
    ReferenceConverter(
        name="budget_vs_transmla",
        experiments=("rorope_zero_shot", "budget_zero_shot"),
        reference_dir="transmla",
        caption="Zero-shot held-out perplexity at equal cached elements per token and layer: ours and TransMLA's own "
        "converter",
        note="The same SmolLM2-135M, the same 32 x 256 calibration rows and the same 32 x 512 held-out rows (original "
        "31.1); TransMLA run by scripts/transmla_reference.py (results/transmla/README.md); one conversion each, "
        "deterministic given the calibration rows. ours / TransMLA: the perplexity ratio with a paired bootstrap "
        "95% interval over the 32 held-out rows; 'not resolved': it contains 1.",
    )
)

# ------------------------------------------------------------------ held-out perplexity, one factor at a time
register(
    PerplexityPairs(
        name="cpu10x_perplexity",
        experiments=("cpu10x_table3", "cpu10x_table5", "cpu10x_seed1", "cpu10x_table1"),
        caption="Held-out perplexity, every pair of rows of cpu10x_table3, cpu10x_table5, cpu10x_seed1, cpu10x_table1 "
        "that differs in one factor",
        question="At 164k fine-tune tokens, which of two configurations that differ in one thing fits held-out text "
        "better? One panel per question: strategy against strategy at equal r, r against r, partial against full "
        "RoPE or NoPE, SVD variants, options.",
    )
)

# ------------------------------------------------------------------ recovery studies
register(
    RecoveryStudy(
        name="recovery_study",
        experiments=("recovery_study",),
        caption="Experiment recovery_study: recovery recipes at equal compute",
    )
)
register(
    RecoveryStudy(
        name="teacher_recovery",
        experiments=("teacher_recovery",),
        caption="Experiment teacher_recovery: recovery recipes at equal compute",
        goal=TEACHER_RECOVERY_GOAL,
    )
)

# ------------------------------------------------------------------ every run
register(DtypeCheck(name="dtype_check", caption="The same model on the same docs, evaluated in two dtypes"))
register(
    PerplexityView(
        name="perplexity",
        caption="Held-out perplexity and the compute behind it, every ok run",
        note="heldout_ppl on the data's held-out split (whole documents never trained on); seconds are wall-clock on "
        "the run's machine (see runs.csv / results.json).",
    )
)
