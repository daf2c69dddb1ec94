"""Gradient compression for DDP: torch's hooks behind a flag, and top-k and int8 with error feedback.

A DDP communication hook receives one gradient bucket at a time (a flat buffer, ~25 MB by default) and
returns a future of the averaged bucket. torch ships fp16/bf16 casting hooks and PowerSGD (low rank, with
error feedback); this module adds two from the classic compression literature:

- **top-k**: each rank sends the ``ratio`` share of each parameter's gradient entries that are largest in
  magnitude (values and int32 indices) and keeps the rest as a residual added to the next step's gradient (error
  feedback, so that nothing is lost, only delayed);
- **int8**: each rank sends each parameter's gradient quantised to int8 with one fp32 scale per 2048 entries,
  rounded stochastically (unbiased: E[q] = x / scale), and keeps the rounding error as its residual.

Both work parameter by parameter inside the bucket: the selection, the scales, the rounding noise (drawn from a
seed of the rank, the parameter and its count of draws) and the residuals do not depend on how DDP buckets the
gradients. DDP's first buckets differ from those it rebuilds after step 1, and from one run to its resumed self: a
resumed run continues its curve exactly.

Both exchange their compressed buckets with one all-gather each (each rank's selection differs, so they cannot be
summed on the wire) and decompress the sum locally; every rank then holds the same averaged bucket. The
invariant the tests check: ``decompress(compress(g + e)) + e' == g + e`` exactly, where ``e`` is the residual
carried in and ``e'`` the one carried out.

:class:`CompressionState` counts the bytes each rank puts on the wire per step (``bytes_sent``), for the
metrics. The hooks run on DDP's reducer thread; their Python work is one compression per parameter.
"""


import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class CompressionState:
    """What a compressing hook carries between steps: each bucket's residual, and the bytes sent."""

    process_group: Any = None
    """The group to all-gather over (None: the default group)."""
    ratio: float = 0.01
    """top-k: share of entries sent."""
    generator: torch.Generator | None = None
    """int8: the source of the stochastic rounding's noise, re-seeded for every parameter's draw."""
    seed: int = 0
    """int8: the run's seed; with the rank, the parameter and its count of draws it seeds each draw."""
    rank: int = 0
    """This process's rank (its noise is its own)."""
    draws: dict[str, int] = field(default_factory=dict)
    """int8: parameter name -> draws so far."""
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameter name -> its flat error carried to the next step (the part of ``g + e`` not sent). Kept per
    parameter, not per bucket: DDP rebuilds its buckets after the first step, in the order gradients arrived."""
    names: dict[int, str] = field(default_factory=dict)
    """``id(parameter)`` -> its name in the DDP module (the residuals' keys, stable across processes)."""
    bytes_sent: int = 0
    """Bytes this rank put on the wire since the last :meth:`take_bytes`."""

    def take_bytes(self) -> int:
        """The bytes sent since the last call (the metrics read this once per step)."""
        n, self.bytes_sent = self.bytes_sent, 0
        return n

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals and counts of draws: what a resumed run needs to continue exactly."""
        return {"residuals": {k: v.to("cpu", copy=True) for k, v in self.residuals.items()},  # views: copied
                "draws": dict(self.draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = {str(k): int(v) for k, v in state["draws"].items()}
        self.residuals = {str(k): v for k, v in state["residuals"].items()}


# ---------------------------------------------------------------- the compressors (pure, tested on their own)
def topk_compress(x: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The largest-magnitude ``ratio`` share of flat ``x``: (values, int32 indices, residual = x - sent)."""
    k = max(1, int(round(ratio * x.numel())))
    indices = x.abs().topk(k, sorted=False).indices
    values = x[indices]
    residual = x.clone()
    residual[indices] = 0
    return values, indices.to(torch.int32), residual


def topk_decompress(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """A dense flat tensor of ``numel`` zeros with ``values`` at ``indices`` (repeated indices add up)."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    out.index_add_(0, indices.long(), values)
    return out


INT8_BLOCK = 2048
"""Entries per int8 scale. One scale per bucket (tens of millions of entries, or the whole model in DDP's first
step) lets one large entry set the step for all: the rounding noise then drowns the gradient."""


def int8_compress(
    x: torch.Tensor, generator: torch.Generator | None = None, block: int = INT8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat ``x`` as int8 with one fp32 scale per ``block`` entries (the last block may be short), stochastically
    rounded: (q, scales, residual = x - decompressed)."""
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)  # ours: divided in place below
    padded[:n] = x.reshape(-1)
    padded = padded.view(blocks, block)
    scale = (padded.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    # two block-sized temporaries, worked in place (the noise becomes the rounded values, then the decompressed
    # ones): one expression per step held up to five, of a size that changes from parameter to parameter, which
    # the device allocator kept cached apart (4 H200s, W1: 74.6 GiB reserved for 41.1 allocated)
    rounded = torch.rand(padded.shape, generator=generator,
                         device=x.device if generator is None else generator.device).to(x.device)
    rounded.add_(padded.div_(scale[:, None])).floor_().clamp_(-127, 127)
    q = rounded.to(torch.int8).view(-1)[:n]
    residual = x - rounded.mul_(scale[:, None]).view(-1)[:n].to(x.dtype)  # the values int8_decompress gives
    return q, scale, residual


def int8_decompress(q: torch.Tensor, scale: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    """The flat values of int8 ``q``, one scale for each ``block`` entries."""
    n = q.numel()
    padded = torch.nn.functional.pad(q.float(), (0, scale.numel() * block - n)).view(scale.numel(), block)
    return (padded * scale.float()[:, None]).view(-1)[:n]


def int8_decompress_pieces(q: torch.Tensor, scale: torch.Tensor, sizes: list[int],
                           block: int = INT8_BLOCK, add_to: torch.Tensor | None = None) -> torch.Tensor:
    """The flat fp32 values of pieces of ``sizes`` quantised one after another (:func:`int8_compress` each, their
    ``q`` and scales concatenated), piece by piece: no per-entry index of scales (8 bytes an entry, for a whole
    bucket) and no whole-bucket temporaries beyond the result. ``add_to`` (flat fp32): add them to it in place and
    return it (every rank's bucket summed into one tensor, not one each)."""
    out = torch.empty(q.numel(), dtype=torch.float32, device=q.device) if add_to is None else add_to
    at = first = 0
    for n in sizes:
        blocks = -(-n // block)
        values = int8_decompress(q[at:at + n], scale[first:first + blocks], block)
        if add_to is None:
            out[at:at + n] = values
        else:
            out[at:at + n] += values
        at += n
        first += blocks
    return out


def _draw_seed(seed: int, rank: int, key: str, count: int) -> int:
    """The seed of one parameter's draw: the same whatever bucket it sits in."""
    return (seed * 1_000_003 + rank * 7_919 + zlib.crc32(key.encode()) * 104_729 + count) % (1 << 63)


# ---------------------------------------------------------------- the DDP hooks
def _world(state: CompressionState) -> int:
    return dist.get_world_size(state.process_group)


def _gather(state: CompressionState, parts: tuple[torch.Tensor, ...]) -> torch.futures.Future[list]:
    """All-gather ``parts`` (the same shapes on every rank) as one collective: the list of every rank's parts.

    One byte tensor rather than one collective per part: a future joined from several (``collect_all``) is not
    ordered after NCCL's stream, so reading its values raced the transfers (garbage indices, on the GPU)."""
    payload = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
    out = [torch.empty_like(payload) for _ in range(_world(state))]
    work = dist.all_gather(out, payload, group=state.process_group, async_op=True)
    state.bytes_sent += payload.numel()
    sizes = [p.numel() * p.element_size() for p in parts]

    def unpack(_: Any) -> list[list[torch.Tensor]]:
        return [[b.view(p.dtype).view(p.shape) for b, p in zip(o.split(sizes), parts)] for o in out]

    return work.get_future().then(unpack)


def _error_fed(
    state: CompressionState,
    bucket: dist.GradBucket,
    compress: Callable[[str, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    dense_sum: Callable[[list[torch.Tensor], list[torch.Tensor], list[int]], torch.Tensor],
) -> torch.futures.Future[torch.Tensor]:
    """The shape of both compressing hooks: per parameter of the bucket, add its carried residual and compress it
    into two tensors (``compress(name, gradient, offset in the bucket)``, keeping the new residual); all-gather the
    bucket's, and write the average of every rank's decompressed bucket into it (``dense_sum(every rank's first
    tensors, their second tensors, the parameters' sizes)``)."""
    buf = bucket.buffer()
    params = bucket.parameters()
    keys = [state.names.get(id(p), f"bucket{bucket.index()}.{i}") for i, p in enumerate(params)]
    sizes = [p.numel() for p in params]
    if sum(sizes) != buf.numel():  # the bucket is the parameters' gradients end to end; anything else is one piece
        keys, sizes = [f"bucket{bucket.index()}"], [buf.numel()]
    parts_a, parts_b, offset = [], [], 0
    for key, x in zip(keys, buf.split(sizes)):
        carried = state.residuals.get(key)
        x = x + carried.to(x.device) if carried is not None and carried.numel() == x.numel() else x.clone()
        a, b, state.residuals[key] = compress(key, x, offset)
        parts_a.append(a)
        parts_b.append(b)
        offset += x.numel()
    world = _world(state)

    def decompress(fut: torch.futures.Future[list]) -> torch.Tensor:
        ranks = fut.value()
        buf.copy_(dense_sum([r[0] for r in ranks], [r[1] for r in ranks], sizes).div_(world))
        return buf

    return _gather(state, (torch.cat(parts_a), torch.cat(parts_b))).then(decompress)


def topk_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: top-k sparsification with error feedback (see the module docstring)."""

    wide = bucket.buffer().numel() >= 2**31  # (DDP's first bucket can hold a whole large model)

    def compress(_key: str, x: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values, indices, residual = topk_compress(x, state.ratio)
        at = indices.long() + offset  # indices into the bucket
        return values, at if wide else at.to(torch.int32), residual

    return _error_fed(state, bucket, compress,
                      lambda values, indices, sizes: topk_decompress(torch.cat(values), torch.cat(indices), sum(sizes)))


def int8_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: int8 quantisation with stochastic rounding and error feedback (see the module docstring)."""

    def compress(key: str, x: torch.Tensor, _offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        count = state.draws.get(key, 0)
        state.draws[key] = count + 1
        generator = state.generator
        if generator is not None:
            generator.manual_seed(_draw_seed(state.seed, state.rank, key, count))
        return int8_compress(x, generator)

    def dense_sum(qs: list[torch.Tensor], scales: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
        total = int8_decompress_pieces(qs[0], scales[0], sizes)
        for q, scale in zip(qs[1:], scales[1:]):
            int8_decompress_pieces(q, scale, sizes, add_to=total)
        return total

    return _error_fed(state, bucket, compress, dense_sum)


class _Counting:
    """Wraps one of torch's hooks to count the bytes it sends (its compressed bucket: the dtype it casts to)."""

    def __init__(
        self,
        hook: Callable,
        wire_bytes_per_element: int | None,
        wire_bytes: Callable[[dist.GradBucket], int] | None = None,
    ) -> None:
        self.hook = hook
        self.__name__ = f"counting_{hook.__name__}"  # DDP logs its hook's name
        self.__qualname__ = self.__name__
        self.wire = wire_bytes_per_element
        self.wire_bytes = wire_bytes
        self.bytes_sent = 0

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.wire_bytes is not None:
            self.bytes_sent += self.wire_bytes(bucket)
        else:
            buf = bucket.buffer()
            self.bytes_sent += buf.numel() * (self.wire or buf.element_size())
        return self.hook(state, bucket)

    def take_bytes(self) -> int:
        n, self.bytes_sent = self.bytes_sent, 0
        return n


def _load_powersgd(ps: Any, saved: dict[str, Any]) -> None:
    """Restore PowerSGD's iteration count: whether it compresses yet. Its error feedback and warm-start factors
    restart from zero: torch keys them by DDP bucket index, and a resumed DDP starts with its first buckets (rebuilt
    after step 1), of other sizes (they are also the size of the gradients, too large to write with every
    checkpoint)."""
    ps.iter = int(saved["iter"])
    log.info("PowerSGD resumes at iteration %d; its error feedback and factors restart from zero", ps.iter)


def _powersgd_wire_bytes(ps: Any) -> Callable[[dist.GradBucket], int]:
    """PowerSGD's bytes per bucket, by its own rule: a full all-reduce before ``start_powerSGD_iter``; then
    each matrix it compresses sends its P (n x r) and Q (m x r) factors in the gradient's dtype, and
    vectors and matrices that would not shrink by ``min_compression_rate`` go uncompressed."""

    def count(bucket: dist.GradBucket) -> int:
        if ps.iter < ps.start_powerSGD_iter:
            return bucket.buffer().numel() * bucket.buffer().element_size()
        total = 0
        for g in bucket.gradients():
            n = g.shape[0] if g.dim() > 1 else g.numel()
            m = g.numel() // max(n, 1)
            r = min(n, m, ps.matrix_approximation_rank)
            compressed = g.dim() > 1 and (n + m) * r * ps.min_compression_rate < n * m
            total += ((n + m) * r if compressed else g.numel()) * g.element_size()
        return total

    return count


def _then(hook: Callable, then: Callable[[list[torch.Tensor]], None] | None) -> Callable:
    """``hook``, followed by ``then(bucket's parameters)`` once the bucket's reduced values are in its buffer
    (with ``gradient_as_bucket_view`` the parameters' ``.grad`` are views of it): the CPU-offloaded optimizer
    takes its gradients there, after the all-reduce rather than before it."""
    if then is None:
        return hook

    def hooked(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        params = bucket.parameters()

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = fut.value()  # the averaged bucket, written into the bucket's buffer by every hook here
            then(params)
            return value

        return hook(state, bucket).then(done)

    hooked.__name__ = getattr(hook, "__name__", "hook")
    hooked.__qualname__ = hooked.__name__
    return hooked


def register_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, name: str, *, process_group: Any = None,
                       powersgd_rank: int = 4, topk_ratio: float = 0.01, seed: int = 0,
                       then: Callable[[list[torch.Tensor]], None] | None = None) -> Any:
    """Install the hook ``name`` (none, fp16, bf16, powersgd, topk, int8) on a DDP model.

    ``then`` (optional) is called with each bucket's parameters once their reduced gradients are in place (see
    :meth:`elbowroom.optim.CPUOffloadOptimizer.after_reduction`).

    Returns:
        The hook's state: an object with ``take_bytes()`` (bytes sent since the last call) and, for the
        hooks that carry error feedback or PowerSGD's factors, ``state_dict()`` / ``load_state_dict()``
        for checkpoints.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    names = {id(p): n for n, p in ddp_model.module.named_parameters()}
    if name == "topk":
        state = CompressionState(process_group=process_group, ratio=topk_ratio, names=names)
        ddp_model.register_comm_hook(state, _then(topk_hook, then))
        return state
    if name == "int8":
        generator = torch.Generator(device=ddp_model.device if ddp_model.device_ids else "cpu")
        state = CompressionState(process_group=process_group, generator=generator, names=names, seed=seed,
                                 rank=dist.get_rank())  # independent noise per rank, the same on every rerun
        ddp_model.register_comm_hook(state, _then(int8_hook, then))
        return state
    if name == "powersgd":
        ps = powerSGD_hook.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=2,
            use_error_feedback=True, warm_start=True, random_seed=seed,
        )
        counting = _Counting(powerSGD_hook.powerSGD_hook, None, wire_bytes=_powersgd_wire_bytes(ps))
        ddp_model.register_comm_hook(ps, _then(counting, then))
        counting.state = ps
        counting.state_dict = lambda: {"powersgd": {"iter": ps.iter}}  # what a checkpoint keeps of it
        counting.load_state_dict = lambda sd: _load_powersgd(ps, sd["powersgd"])
        return counting
    hooks = {
        "none": (default_hooks.allreduce_hook, None),
        "fp16": (default_hooks.fp16_compress_hook, 2),
        "bf16": (default_hooks.bf16_compress_hook, 2),
    }
    if name not in hooks:
        raise ValueError(f"unknown comm hook {name!r}; choose none, fp16, bf16, powersgd, topk or int8")
    hook, wire = hooks[name]
    counting = _Counting(hook, wire)
    ddp_model.register_comm_hook(process_group, _then(counting, then))
    return counting
