"""Training and held-out text: sources (offline assets, local files, hub mixture), document split,
packing, on-disk token cache, calibration sampling and token-budget accounting."""

from .budget import pretrain_share_pct, steps_for_tokens, token_budget, tokens_per_step
from .packing import Packed, concat_documents, is_held_out, pack
from .prepare import PreparedData, calibration_batches, prepare_data, tokenizer_fingerprint
from .sources import check_data_config, iter_documents, local_files

__all__ = [
    "PreparedData", "Packed", "calibration_batches", "check_data_config", "concat_documents", "is_held_out",
    "iter_documents", "local_files", "pack", "prepare_data", "pretrain_share_pct", "steps_for_tokens",
    "token_budget", "tokenizer_fingerprint", "tokens_per_step",
]
