"""Training and held-out text: sources (offline assets, local files, hub mixture), document split,
packing, on-disk token cache and calibration sampling (the token budget is train/budget.py's)."""

from .packing import Packed, concat_documents, is_held_out, pack
from .prepare import PreparedData, StreamedData, calibration_batches, prepare_data
from .rows import FiniteRows, local_rows
from .sources import check_data_config, iter_documents, local_files
from .stream import TrainStream
from .tokens import tokenizer_fingerprint

__all__ = [
    "FiniteRows",
    "PreparedData",
    "Packed",
    "StreamedData",
    "TrainStream",
    "calibration_batches",
    "check_data_config",
    "concat_documents",
    "is_held_out",
    "iter_documents",
    "local_files",
    "local_rows",
    "pack",
    "prepare_data",
    "tokenizer_fingerprint",
]
