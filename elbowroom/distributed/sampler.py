"""Each data-parallel rank's slice of every global batch, from one stream that does not depend on the ranks.

``data.batch_size`` is the *global* batch of one micro-step. The sample stream is the single-process one
(``elbowroom.train.data.ResumableSampler``: a function of the seed and the position alone), cut into
consecutive global batches; rank ``r`` of ``n`` takes the ``r``-th of ``n`` equal parts of each. The data
position saved in a checkpoint is the number of samples of that stream consumed, so a run resumed at another
data-parallel size continues on exactly the samples an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler


class RankBatchSampler(Sampler[list[int]]):
    """Batches of ``global_batch // dp_size`` indices: this rank's part of each global batch.

    Args:
        sampler: an endless index stream (every rank must build the same one).
        global_batch: samples per global micro-batch; must divide by ``dp_size``.
        dp_rank: this rank's index among the data-parallel ranks.
        dp_size: data-parallel ranks.
    """

    def __init__(self, sampler: Sampler[int], *, global_batch: int, dp_rank: int, dp_size: int) -> None:
        if global_batch % dp_size:
            raise ValueError(
                f"data.batch_size {global_batch} (the global batch) must divide by the data-parallel size "
                f"{dp_size}; use a multiple of {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.sampler = sampler
        self.global_batch = global_batch
        self.local = global_batch // dp_size
        self.lo = dp_rank * self.local

    def __iter__(self) -> Iterator[list[int]]:
        it = iter(self.sampler)
        while True:
            batch = [next(it) for _ in range(self.global_batch)]  # every rank draws the whole global batch
            yield batch[self.lo : self.lo + self.local]

    def __len__(self) -> int:  # endless; DataLoader asks only when it must
        raise TypeError("RankBatchSampler is endless")
