"""The trainer's data layer: datasets, collation, resumable sampling, loaders, prefetch.

The flow is ``prepare`` (text -> ``.bin``, once; ``elbowroom.train.tokens``) -> ``load_tokens`` -> ``split`` ->
``ChunkDataset`` or ``DocumentDataset`` -> ``build_dataloader`` (exactly resumable, never touches the global RNG)
-> ``DevicePrefetcher`` (host-to-device copies overlapped with compute). The token-file functions are re-exported
here, so ``elbowroom.train.data`` remains the one import of the trainer's data layer.
"""

from __future__ import annotations

import atexit
import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from elbowroom.train.tokens import (  # noqa: F401 - re-exported: the data layer's one import
    BYTE_EOS_ID,
    TOKEN_FORMAT,
    TOKEN_FORMAT_VERSION,
    DataError,
    TokenFile,
    _eos_positions,
    _is_whole_memmap,
    build_default_corpus,
    check_vocab,
    default_cache_dir,
    load_tokens,
    prepare,
    sidecar_path,
    split,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DataError",
    "TokenFile",
    "load_tokens",
    "prepare",
    "split",
    "check_vocab",
    "sidecar_path",
    "default_cache_dir",
    "build_default_corpus",
    "ChunkDataset",
    "DocumentDataset",
    "collate",
    "pad_collate",
    "ResumableSampler",
    "build_dataloader",
    "build_eval_loader",
    "DevicePrefetcher",
    "IGNORE_INDEX",
]

IGNORE_INDEX = -100
"""Target value at padded positions; ``F.cross_entropy`` ignores it by default."""


# --------------------------------------------------------------------------------------------------
# Datasets and collation
# --------------------------------------------------------------------------------------------------


class _TokenDataset(Dataset):
    """Pickles a whole-file memmap by (file, offset, length), so worker processes started with spawn
    or forkserver map the file again instead of receiving a copy of all its tokens."""

    tokens: np.ndarray

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if _is_whole_memmap(self.tokens):
            t = self.tokens
            state["tokens"] = ("memmap", t.filename, t.dtype.str, t.offset, len(t))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["tokens"], tuple):
            _, filename, dtype, offset, length = state["tokens"]
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))
        self.__dict__.update(state)


def _check_seq_len(seq_len: int) -> None:
    if seq_len <= 0:
        raise DataError(f"seq_len must be positive, got {seq_len}")


def _sample(window: np.ndarray) -> dict[str, torch.Tensor]:
    ids = torch.from_numpy(window.astype(np.int64))
    return {"input_ids": ids[:-1], "targets": ids[1:]}


class ChunkDataset(_TokenDataset):
    """Fixed-length training windows: item ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``.

    Windows share one token with the next, so every token but the first is a target exactly once.
    Items are ``{"input_ids": LongTensor[seq_len], "targets": LongTensor[seq_len]}``, targets being
    the inputs shifted one to the left.

    Args:
        tokens: 1-D token array (a memmap stays a memmap: items are read on demand).
        seq_len: Tokens per sample.
        name: What the tokens are, for error messages ("validation split", a file name).

    Raises:
        DataError: Fewer than ``seq_len + 1`` tokens.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, name: str = "token data") -> None:
        _check_seq_len(seq_len)
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"{name} has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; use more data, "
                "a smaller seq_len, or (for the validation split) a larger val_fraction"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"ChunkDataset index {index} out of range [0, {len(self)})")
        start = index * self.seq_len
        return _sample(self.tokens[start : start + self.seq_len + 1])


class DocumentDataset(_TokenDataset):
    """Variable-length samples, one per document: item ``i`` is document (piece) ``i``.

    A document is the tokens after the previous ``eos_id`` up to and including its own ``eos_id``, so
    the model learns to end documents; trailing tokens without an eos form a last document. Documents
    longer than ``seq_len + 1`` tokens are cut into pieces of at most ``seq_len + 1`` tokens that share
    one token with the next piece (as ChunkDataset's windows do), so no target is lost. Pieces of fewer
    than 2 tokens (empty documents) have no target and are dropped. Boundaries are indexed once, with
    vectorised numpy. Batch with :func:`pad_collate`.

    Args:
        tokens: 1-D token array.
        seq_len: Longest sample (tokens of ``input_ids``).
        eos_id: The end-of-document token.
        name: What the tokens are, for error messages.

    Raises:
        DataError: ``eos_id`` is None, or the tokens hold no document with a target.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, eos_id: int | None, *, name: str = "token data") -> None:
        _check_seq_len(seq_len)
        if eos_id is None:
            raise DataError(
                f"{name} has no eos_id, so it cannot be split into documents; use ChunkDataset, or "
                "prepare the data with an end-of-document token"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.starts, self.lengths = self._index(tokens, seq_len, eos_id)
        if len(self.starts) == 0:
            raise DataError(f"{name} holds no document of 2 or more tokens; use more data")

    @staticmethod
    def _index(tokens: np.ndarray, seq_len: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
        ends = _eos_positions(tokens, eos_id) + 1  # exclusive: each document keeps its eos
        if len(ends) == 0 or ends[-1] < len(tokens):
            ends = np.append(ends, len(tokens))
        starts = np.concatenate(([0], ends[:-1])).astype(np.int64)
        lengths = ends - starts
        keep = lengths >= 2
        starts, ends, lengths = starts[keep], ends[keep], lengths[keep]
        # A document of L tokens has L - 1 targets; pieces of seq_len targets each: ceil((L - 1) / seq_len).
        num_pieces = (lengths - 2) // seq_len + 1
        doc = np.repeat(np.arange(len(starts)), num_pieces)
        first_piece = np.cumsum(num_pieces) - num_pieces
        piece_in_doc = np.arange(len(doc)) - first_piece[doc]
        piece_starts = starts[doc] + piece_in_doc * seq_len
        piece_lengths = np.minimum(seq_len + 1, ends[doc] - piece_starts)
        return piece_starts, piece_lengths

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, length = int(self.starts[index]), int(self.lengths[index])
        return _sample(self.tokens[start : start + length])


def collate(batch: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """Stacks fixed-length samples (from ChunkDataset).

    Returns:
        ``{"input_ids": LongTensor[b, s], "targets": LongTensor[b, s], "num_tokens": b * s}``, where
        ``num_tokens`` is a Python int, so summing it over micro-batches needs no host-device sync.
    """
    input_ids = torch.stack([sample["input_ids"] for sample in batch])
    targets = torch.stack([sample["targets"] for sample in batch])
    return {"input_ids": input_ids, "targets": targets, "num_tokens": targets.numel()}


def pad_collate(batch: Sequence[Mapping[str, torch.Tensor]], pad_id: int = 0) -> dict[str, Any]:
    """Right-pads variable-length samples (from DocumentDataset) to the longest of the batch.

    Args:
        batch: Samples with 1-D ``input_ids`` and ``targets`` of equal length.
        pad_id: Input token at padded positions (never a target, so its value does not matter).

    Returns:
        ``{"input_ids": LongTensor[b, s], "targets": LongTensor[b, s], "num_tokens": int}``: targets
        are ``IGNORE_INDEX`` (-100) at padded positions and ``num_tokens`` counts the others, as a
        Python int counted on the host.
    """
    lengths = [len(sample["input_ids"]) for sample in batch]
    longest = max(lengths)
    input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    targets = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)
    for row, (sample, length) in enumerate(zip(batch, lengths, strict=True)):
        input_ids[row, :length] = sample["input_ids"]
        targets[row, :length] = sample["targets"]
    return {"input_ids": input_ids, "targets": targets, "num_tokens": sum(lengths)}


# --------------------------------------------------------------------------------------------------
# Sampling and loading
# --------------------------------------------------------------------------------------------------


class ResumableSampler(Sampler[int]):
    """An endless stream of dataset indices that a resumed run can re-enter at any sample.

    Epoch ``e`` is a permutation of ``range(num_items)`` drawn from
    ``torch.Generator().manual_seed(seed + e)`` (or ``range(num_items)`` itself without shuffling), so
    the stream is a function of ``seed`` alone. Iteration starts at global position ``start`` (epoch
    ``start // num_items``, offset ``start % num_items``): a run resumed at sample ``p`` sees exactly
    the samples an uninterrupted run sees from ``p`` on. The global torch RNG is never used.

    Args:
        num_items: Dataset length.
        seed: Base seed of the per-epoch permutations.
        start: Global sample position to start from (samples consumed before a resume).
        shuffle: Permute each epoch; False yields ``0, 1, ..., num_items - 1`` repeatedly.
    """

    def __init__(self, num_items: int, *, seed: int, start: int = 0, shuffle: bool = True) -> None:
        if num_items <= 0:
            raise DataError(f"ResumableSampler needs at least one item, got num_items={num_items}")
        if start < 0:
            raise DataError(f"start must be >= 0, got {start}")
        self.num_items = num_items
        self.seed = seed
        self.start = start
        self.shuffle = shuffle

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The indices of ``epoch`` in the order they are sampled (an int64 tensor)."""
        if not self.shuffle:
            return torch.arange(self.num_items)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_items, generator=generator)

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.start, self.num_items)
        while True:
            # Converted to Python ints a block at a time: a list of all of them would cost ~35 bytes each.
            for block in self.epoch_order(epoch)[offset:].split(2**16):
                yield from block.tolist()
            epoch, offset = epoch + 1, 0


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    seed: int,
    start_sample: int,
    num_workers: int,
    pin_memory: bool,
    persistent_workers: bool,
    collate_fn: Callable[[list[Any]], Any],
    shuffle: bool = True,
    drop_last: bool = True,
    dp_rank: int = 0,
    dp_size: int = 1,
    worker_init_fn: Callable[[int], None] | None = None,
) -> DataLoader:
    """An endless, exactly resumable training loader.

    Batches are consecutive ``batch_size`` runs of a :class:`ResumableSampler` stream, so after ``k``
    batches a run resumes with ``start_sample = start_sample + k * batch_size`` and sees the same
    batches an uninterrupted run would. Batches may span an epoch boundary; the stream never ends, so
    ``drop_last`` never drops anything. The loader gets its own ``torch.Generator``: creating an
    iterator draws the workers' base seed from it, not from the global RNG (which would shift every
    later dropout mask and break exact resume). Workers ignore SIGINT and SIGTERM: the trainer's main process
    handles Ctrl-C and a scheduler's SIGTERM to the whole process group (finish the step, save, exit), still needs
    the batch in flight, and shuts the workers down itself.

    Args:
        dataset: A map-style dataset.
        batch_size: Samples per batch.
        seed: Seeds the sample order (and the loader's generator).
        start_sample: Samples of the stream already consumed (0 for a fresh run).
        num_workers: Loader worker processes; 0 loads in the main process.
        pin_memory: Pin batches for asynchronous host-to-device copies; ignored without CUDA.
        persistent_workers: Keep workers between iterators; ignored when ``num_workers`` is 0.
        collate_fn: ``collate`` for fixed-length samples, ``pad_collate`` for documents.
        shuffle: Permute each epoch.
        drop_last: Passed to the BatchSampler.
        dp_rank: Under data parallel, this rank's index: it reads its part of each ``batch_size`` (global) batch.
        dp_size: Data-parallel ranks (``batch_size`` must divide by it).
        worker_init_fn: Called in each worker as DataLoader calls it, after the stop signals are ignored.

    Returns:
        The DataLoader; iterate it as long as training runs.
    """
    if batch_size <= 0:
        raise DataError(f"batch_size must be positive, got {batch_size}")
    sampler = ResumableSampler(len(dataset), seed=seed, start=start_sample, shuffle=shuffle)
    if dp_size > 1:  # the same stream on every rank, each global batch cut into the ranks' parts
        from elbowroom.distributed.sampler import RankBatchSampler

        batches: Sampler[list[int]] = RankBatchSampler(sampler, global_batch=batch_size, dp_rank=dp_rank,
                                                       dp_size=dp_size)
    else:
        batches = BatchSampler(sampler, batch_size, drop_last=drop_last)
    loader = DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=_pin_memory(pin_memory),
        persistent_workers=persistent_workers and num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=functools.partial(_ignore_stop_signals, then=worker_init_fn) if num_workers > 0 else None,
    )
    if num_workers > 0:
        # Workers that ignore SIGTERM outlive multiprocessing's exit handler (it terminates and joins them: the join
        # would wait forever when a traceback keeps the loader alive to the end). This handler, registered after
        # that one, runs before it and stops them the way DataLoader does when it is collected.
        atexit.register(_shut_down_workers, weakref.ref(loader))
    return loader


def _shut_down_workers(loader_ref: weakref.ref[DataLoader]) -> None:
    loader = loader_ref()
    it = getattr(loader, "_iterator", None)  # persistent workers: the loader holds its iterator (torch's own name)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def _ignore_stop_signals(worker_id: int, then: Callable[[int], None] | None = None) -> None:
    # Ctrl-C in a terminal, and `kill -TERM -- -PGID` from a scheduler, reach the whole process group: a worker
    # that died of either would fail the batch the main process is waiting for, before it could save. The main
    # process decides how the run stops, and shuts the workers down when its loader goes.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if then is not None:
        then(worker_id)


def build_eval_loader(
    dataset: Dataset,
    batch_size: int,
    num_batches: int,
    collate_fn: Callable[[list[Any]], Any],
    *,
    pin_memory: bool = False,
) -> DataLoader:
    """The first ``num_batches`` batches of ``dataset`` in order: the same every evaluation.

    Args:
        dataset: A map-style dataset (the validation split).
        batch_size: Samples per batch.
        num_batches: Batches per evaluation; fewer (the last one possibly short) if the dataset is small.
        collate_fn: ``collate`` or ``pad_collate``.
        pin_memory: Pin batches; ignored without CUDA.

    Returns:
        A finite DataLoader, loading in the main process.
    """
    if batch_size <= 0 or num_batches <= 0:
        raise DataError(f"eval batch_size and num_batches must be positive, got {batch_size} and {num_batches}")
    num_samples = min(len(dataset), batch_size * num_batches)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=range(num_samples),
        drop_last=False,
        collate_fn=collate_fn,
        pin_memory=_pin_memory(pin_memory),
        generator=torch.Generator().manual_seed(0),  # creating an iterator must not draw from the global RNG
    )


def _pin_memory(requested: bool) -> bool:
    # torch.cuda.is_available() asks the driver for a device count without creating a CUDA context.
    return requested and torch.cuda.is_available()


# --------------------------------------------------------------------------------------------------
# Host-to-device prefetch
# --------------------------------------------------------------------------------------------------


def _to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        return {key: _to_device(v, device, non_blocking) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, non_blocking) for v in value)
    return value  # num_tokens and other host values pass through


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


_END = object()


class DevicePrefetcher:
    """Iterates batches already on ``device``; on CUDA the next batch's copy overlaps the current step.

    On CUDA, batch ``k + 1`` is copied host-to-device on a side stream (``non_blocking=True``, which
    is asynchronous when the loader pinned the batch) as soon as batch ``k`` is handed out. Before a
    batch is handed out the consumer's current stream waits on the event recorded after its copy. On
    any other device tensors are moved with a plain synchronous ``.to(device)``. Non-tensor values
    (``num_tokens``) pass through unchanged. Iteration ends when ``iterable`` ends.

    Args:
        iterable: Yields batches (dicts, lists or tuples of tensors and host values).
        device: Where the batches go.
    """

    def __init__(self, iterable: Iterable[Any], device: torch.device | str) -> None:
        self.iterable = iterable
        self.device = torch.device(device)
        self._is_cuda = self.device.type == "cuda"
        self._iterator: Iterator[Any] | None = None
        self._next: Any = _END
        self._ready: torch.cuda.Event | None = None
        self._stream: torch.cuda.Stream | None = None

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            threads = torch.get_num_threads()
            self._iterator = iter(self.iterable)
            if self._is_cuda:
                self._stream = torch.cuda.Stream(self.device)
                self._prefetch()
                # a DataLoader's pinning thread sets torch's thread count to 1 for the whole process when it
                # starts (it has, once the first batch came back pinned): the training thread's host work
                # (host gradient norms, the optimizer's CPU-side calls) gets its threads back
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
        if not self._is_cuda:
            return _to_device(next(self._iterator), self.device)  # StopIteration ends us too
        batch = self._next
        if batch is _END:
            raise StopIteration
        current = torch.cuda.current_stream(self.device)
        # Stream wait: kernels queued on the consumer's stream from here on start after the copy landed.
        current.wait_event(self._ready)
        # Lifetime: these tensors were allocated on the side stream, so the caching allocator would hand
        # their blocks to the next side-stream allocation as soon as the consumer drops them, even while
        # kernels on the current stream that read them are still queued, and the next prefetch would
        # overwrite them. record_stream makes the allocator wait for the current stream's work queued at
        # free time before reusing the block. It is simpler than allocating on the current stream and
        # costs only that the memory returns to the pool one step later.
        for tensor in _tensors(batch):
            tensor.record_stream(current)
        self._prefetch()
        return batch

    def _prefetch(self) -> None:
        assert self._iterator is not None and self._stream is not None
        try:
            host_batch = next(self._iterator)
        except StopIteration:
            self._next = _END
            return
        # The pinned host batch may be freed once the copy is queued: the copy records an event on its
        # pinned block and the host caching allocator does not reuse the block before that event.
        with torch.cuda.stream(self._stream):
            self._next = _to_device(host_batch, self.device, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(self._stream)
