"""Training and held-out text: sources (offline assets, local files, hub mixture), document split,
packing, on-disk token cache, calibration sampling and token-budget accounting."""

from .budget import check_epochs, pretrain_share_pct, steps_for_tokens, token_budget, tokens_per_step
from .packing import Packed, concat_documents, is_held_out, pack
from .prepare import PreparedData, StreamedData, calibration_batches, prepare_data, tokenizer_fingerprint
from .rows import FiniteRows, local_rows
from .sources import check_data_config, iter_documents, local_files
from .stream import TrainStream

__all__ = [
    "FiniteRows", "PreparedData", "Packed", "StreamedData", "TrainStream", "calibration_batches", "check_data_config",
    "check_epochs", "concat_documents", "is_held_out", "iter_documents", "local_files", "local_rows", "pack",
    "prepare_data", "pretrain_share_pct", "steps_for_tokens", "token_budget", "tokenizer_fingerprint",
    "tokens_per_step",
]
