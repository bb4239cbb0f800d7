"""Training rows as a function of the optimizer step: what a fine-tune reads at step s.

Both sources hand out the `rows_per_step` rows of one global step (all processes, all micro-batches);
each process then takes its own slice (`local_rows`), laid out so that N processes with the same global
batch read exactly the rows one process reads with N times the gradient accumulation.

- `FiniteRows`: an in-memory corpus (offline assets, local text). Global row i is drawn epoch by epoch
  in a seeded order, a pure function of (seed, i); reading past one epoch repeats text, which the runner
  refuses unless `train.epochs_allowed`.
- `data.stream.TrainStream`: a streamed corpus read in order, fresh tokens at any budget.
"""

from __future__ import annotations

import torch


class FiniteRows:
    def __init__(self, rows: torch.Tensor, seed: int):
        if rows.shape[0] == 0:
            raise ValueError("the training split has no full row")
        self.rows, self.seed = rows, seed
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def seq_len(self) -> int:
        return self.rows.shape[1]

    @property
    def tokens_available(self) -> int:
        return self.rows.numel()

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {
                epoch: torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed + epoch))
            }
        return self._orders[epoch]

    def step_rows(self, step: int, rows_per_step: int) -> torch.Tensor:
        out = []
        for i in range(step * rows_per_step, (step + 1) * rows_per_step):
            epoch, j = divmod(i, len(self.rows))
            out.append(self.rows[self._order(epoch)[j]])
        return torch.stack(out)

    def epochs(self, rows_read: int) -> float:
        return rows_read / len(self.rows)

    def state_dict(self) -> dict:  # the position is the step itself
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def rechunk(rows: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Re-cut packed rows to `seq_len` (the packed stream is contiguous text, so this loses no order)."""
    flat = rows.reshape(-1)
    n = flat.numel() // seq_len
    if n == 0:
        raise ValueError(f"the training split has {flat.numel()} tokens, fewer than one sequence of {seq_len}")
    return flat[: n * seq_len].view(n, seq_len)


def local_rows(step_rows: torch.Tensor, micro: int, process: int, num_processes: int, micro_batch_size: int):
    """The rows of micro-batch `micro` on `process`: micro-batches interleave processes, so the global
    order of rows is the same for any split of the global batch into processes x accumulation steps."""
    start = (micro * num_processes + process) * micro_batch_size
    return step_rows[start : start + micro_batch_size]
