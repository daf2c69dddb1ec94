"""Profile a model for the planner: per block what it saves (by kind) and what it costs, and the head.

::

    import elbowroom
    from elbowroom.plan import profile
    prof = profile(model, input_ids)                       # measured on the model's device
    with torch.device("meta"):                             # a model that fits nowhere: build it on meta
        big = build_model(cfg)                             # (or LlamaForCausalLM(config))
    prof = profile(big, torch.zeros(1, 4096, dtype=torch.long), machine="h100-80gb")   # analytic

How each number is obtained (one or two traced steps, plus a few timed ones when measured):

- **Bytes**: one forward + backward with saved-tensor hooks and an op recorder (see :mod:`._trace`).
  Every tensor autograd saves is attributed to the block running and classified by the op that produced
  its storage: ``matmul`` (mm/addmm/bmm/baddbmm), ``attention`` (the fused SDPA kernels: output and
  logsumexp), ``input`` (the block's residual-stream input), ``pointwise`` (everything else: norms,
  activations, casts of activations, dropout masks). Each storage counts once per block, views included
  (what the offload engine moves). Not counted per block: parameters, buffers and tensors computed from
  them alone (the bf16 copies of weights autocast saves, RoPE tables): model state, reported per block in
  ``extra["state_saved_bytes"]``; and other block inputs made once for all blocks (Hugging Face's rotary
  cos/sin, masks): ``extra["shared_saved_bytes"]``.
- **Selective bytes**: a second step with every block under ``elbowroom.checkpoint(block, "selective")``:
  what the hooks see (the inputs the checkpoint saves) plus the storages the block produced that are
  still alive after its forward (the matmul/attention outputs the checkpoint's cache keeps). Measured, not
  predicted.
- **Times, measured**: per block forward (pre/post hooks) and backward (gradient hooks on the block's
  output and input) on CUDA events, or ``time.perf_counter`` on a CPU; the median over ``iters`` steps after
  ``warmup`` steps, plain, under full and under selective checkpoint: recompute time is the difference
  in backward time. The head is the step minus the blocks.
- **Times, analytic**: forward = each matmul and attention kernel's time from its shape
  (:mod:`elbowroom.plan.kernels`: a GEMM's FLOPs at ``machine.matmul_flops`` plus its operands and output at
  ``machine.memory_bandwidth``; attention by the score tiles it walks, causal ones on and below the diagonal) + 2 x
  pointwise saved bytes / ``machine.memory_bandwidth`` (a pointwise op writes its output once and the next op reads
  it; the documented assumption), backward = its kernels' times + twice the forward's memory term; full recompute =
  forward, selective recompute = the forward's memory term. FLOPs stay torch's formulas (``FlopCounterMode``'s
  registry, counted per block, forward and backward apart; attention without the causal mask's saving, as torch
  counts it); ops with FLOPs the kernel model does not know are timed at ``machine.matmul_flops``.
- **Analytic bytes**: the same traced step on the meta device (no memory, no device); autocast and the
  attention kernel are emulated as the target device would run them (:class:`._trace.MetaEmulation`).
  The bytes equal a measured trace of the same model (tested on CPU, fp32 and bf16 autocast). On CUDA
  the reference models' fused RoPE and SwiGLU kernels save less than their eager forms (which the meta
  trace runs), so an analytic profile of those models overstates their pointwise bytes slightly.

Cost: two traced steps (plain, then a selective forward) and, when measured, ``warmup + iters`` timed steps
in each of three modes (plain, full, selective): 11 steps with the defaults. The traced steps run an op
recorder in Python and are several times slower than a plain step; the timed steps run without it.

Profiling leaves the model as it found it: training flags restored, no hooks or wrappers left, gradients
set to None, the CPU (and CUDA) RNG state restored so that a later run draws the same dropout masks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from elbowroom.activations import _wrap
from elbowroom.activations.compiled import compile_blocks, is_compiled, uncompile_blocks
from elbowroom.activations.recompute import checkpoint, reentrant_default, uncheckpoint
from elbowroom.plan import kernels
from elbowroom.plan._trace import HEAD, KINDS, Clock, MetaEmulation, OpRecorder, Tracer, skey
from elbowroom.plan.devices import expandable_segments, get_device
from elbowroom.plan.machine import measure_machine
from elbowroom.plan.types import BlockProfile, HeadProfile, MachineProfile, Profile

__all__ = ["profile"]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]

_POINTWISE_TRAFFIC = 2.0
"""Bytes moved in forward per pointwise byte saved (written once, read once): the analytic memory term."""

OVERHEAD_STEPS = 2
"""Steps of each kind (plain, selective) over which the allocator's overhead is measured, with each setting
(:meth:`_Runner._overhead`): a plain 7B step held the same from its first step to its sixth."""


def _resolve_blocks(model: nn.Module, blocks: Sequence[nn.Module] | str | None) -> tuple[list[nn.Module], str]:
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is None:
        from elbowroom.plan.apply import resolve_blocks  # found as fit and apply find them, with the same error

        found = resolve_blocks(model, None)
        return list(found), names.get(id(found), "")
    if isinstance(blocks, str):
        try:
            found = model.get_submodule(blocks)
        except AttributeError as e:
            raise ValueError(f"blocks={blocks!r} is not a submodule path of {type(model).__name__}: {e}") from e
        if not isinstance(found, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"blocks={blocks!r} is a {type(found).__name__}; give the path of a ModuleList")
        return list(found), blocks
    out = list(blocks)
    if not out or not all(isinstance(b, nn.Module) for b in out):
        raise TypeError("blocks= takes a non-empty list of modules of the model, or a dotted path such as "
                        "'model.layers'")
    for b in out:
        if id(b) not in names:
            raise ValueError(f"a {type(b).__name__} given in blocks= is not a submodule of the model")
    common = {names[id(b)].rpartition(".")[0] for b in out}
    return out, common.pop() if len(common) == 1 else ""


def _unique_params(modules: Sequence[nn.Module]) -> dict[int, nn.Parameter]:
    out: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            out.setdefault(id(p), p)
    return out


def _nbytes(params: Mapping[int, torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params.values())


def _signature(block: nn.Module) -> str:
    shapes = ",".join("x".join(map(str, p.shape)) for p in block.parameters())
    return f"{type(block).__name__}({shapes})"


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        if out.dim() < 2:  # a model that computes its own loss
            raise TypeError(f"the model returned a tensor of shape {tuple(out.shape)}, not logits (batch, seq, vocab); "
                            "if it is the loss, pass loss_fn=lambda model, batch: model(batch)")
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        logits = out[0]
    if logits is None:
        raise TypeError(f"the model returned a {type(out).__name__} without logits; pass loss_fn=")
    return logits


class _Step:
    """One training micro-step's forward and loss, for the batch forms :func:`profile` accepts."""

    def __init__(self, model: nn.Module, batch: Any, loss_fn: LossFn | None) -> None:
        self.model, self.batch, self.loss_fn = model, batch, loss_fn
        if loss_fn is None and isinstance(batch, (tuple, list)) and len(batch) != 2:
            raise TypeError(f"a tuple sample batch is (inputs, targets), not {len(batch)} items; pass "
                            "loss_fn=lambda model, batch: ... to compute the loss of another form")
        # training never uses a KV cache; Hugging Face models build one unless told (it would hold k and v)
        self.extra = {"use_cache": False} if _accepts(model.forward, "use_cache") else {}
        self.vocab = 0

    def __call__(self) -> torch.Tensor:
        model, batch = self.model, self.batch
        if self.loss_fn is not None:
            loss = self.loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                tensor = isinstance(loss, torch.Tensor)
                got = f"a tensor of shape {tuple(loss.shape)}" if tensor else f"a {type(loss).__name__}"
                raise TypeError(f"loss_fn(model, batch) must return the scalar loss, not {got}: reduce it (e.g. "
                                ".mean()) inside loss_fn")
            return loss
        if isinstance(batch, Mapping):
            out = model(**{**self.extra, **batch})
            loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
            if loss is None:
                raise ValueError("the model returned no loss for the dict batch: add 'labels' to it or pass loss_fn=")
            with contextlib.suppress(TypeError):
                self.vocab = _logits(out).shape[-1]
            return loss
        if isinstance(batch, (tuple, list)):
            inputs, targets = batch
            logits = _logits(model(inputs, **self.extra))
        else:
            # next-token prediction on the ids themselves: position t predicts token t + 1
            logits = _logits(model(batch, **self.extra))[:, :-1]
            targets = batch[:, 1:]
        self.vocab = logits.shape[-1]
        # the loss in fp32, as the trainer computes it (autocast-independent)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _batch_shape(batch: Any) -> tuple[int, int]:
    ids = batch
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
    elif isinstance(batch, (tuple, list)):
        ids = batch[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        raise TypeError("sample_batch must be a (batch, seq) tensor of token ids, an (inputs, targets) pair, or a "
                        "dict with 'input_ids'")
    return int(ids.shape[0]), int(ids.shape[1])


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors of the same shapes and dtypes
    (no data is copied: the copy costs only the module objects)."""
    import copy

    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def bf16_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on its device as :func:`~elbowroom.plan.apply.apply` runs the planner's "bf16" layout:
    every floating parameter in bf16, buffers (rotary tables) in their own dtype. Made without an fp32 copy first:
    the module objects are copied on meta, then each tensor is allocated and filled from the model's by name,
    non-persistent buffers included. Tied weights stay tied (one tensor, as in the model)."""
    device = _model_device(model)
    copy = meta_copy(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    made: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for prefix, mod in copy.named_modules(remove_duplicate=False):
            for table, source in ((mod._parameters, params), (mod._buffers, buffers)):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in made:
                        src = source[f"{prefix}.{name}" if prefix else name]
                        bf16 = isinstance(t, nn.Parameter) and t.is_floating_point()
                        new = torch.empty_like(t, device=device, dtype=torch.bfloat16 if bf16 else t.dtype)
                        new.copy_(src)
                        made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                    table[name] = made[id(t)]
    return copy


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    if p is None:
        raise ValueError(f"{type(model).__name__} has no parameters to profile")
    return p.device


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def profile(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None = None,
    source: str = "auto",
    machine: MachineProfile | str | None = None,
    dtype: torch.dtype | None = None,
    blocks: Sequence[nn.Module] | str | None = None,
    cache_dir: str | None = None,
    warmup: int = 1,
    iters: int = 3,
    reentrant: bool | None = None,
    compiled: bool | Mapping[str, Any] = False,
) -> Profile:
    """Profile ``model`` on one micro-batch: per block saved bytes by kind and times, the head, the machine.

    Args:
        model: the model to train: elbowroom's reference models (``model(ids) -> logits``), a Hugging Face
            causal LM, or any module with repeated blocks. On the meta device for the analytic source
            (build it under ``with torch.device("meta"):`` when it fits nowhere).
        sample_batch: one micro-batch: a ``(batch, seq)`` tensor of token ids (loss = next-token
            cross-entropy on the logits), an ``(inputs, targets)`` pair (cross-entropy of the logits
            against ``targets``), or a dict of keyword arguments (loss = ``out.loss``: include ``labels``).
            Moved to the model's device.
        loss_fn: ``loss_fn(model, batch) -> loss`` replaces the default loss.
        source: "measured" (run on the model's device), "analytic" (trace on meta; the model must be on
            meta), or "auto" (analytic for a model on meta, else measured).
        machine: a :class:`MachineProfile`, a device table name (``"h100-80gb"``), or None: measured for the
            model's device (cached in ``cache_dir``), ``h100-80gb`` for an analytic profile.
        dtype: compute dtype. Autocast to it when it differs from the parameters' dtype. None: bfloat16 on
            CUDA and for an analytic profile for a GPU, else the parameters' dtype.
        blocks: the repeated blocks (a list of modules, or a dotted path such as ``"model.layers"``); None
            finds them (:func:`elbowroom.activations.recompute.find_blocks`).
        cache_dir: where :func:`measure_machine` caches the machine's numbers (None: no cache).
        warmup: untimed steps before each timed mode (measured source).
        iters: timed steps per mode, the median counts (measured source). Three, so that one slow step is
            rejected (with two the median is their mean). Near-equal plans still differ from fit to fit: W1 at
            16 GiB gave two plans in one call, at 91.7% and 93.2% of plain (BENCHMARKS.md).
        reentrant: time whole-block recompute with torch's reentrant checkpoint, as the plan will run it (None:
            :func:`~elbowroom.activations.recompute.reentrant_default`).
        compiled: the blocks will run compiled (:func:`~elbowroom.activations.compile_blocks`, the trainer's
            ``--train.compile``): the times are measured with the blocks compiled, and so are the bytes they save
            kept whole and under selective recompute (saved-tensor hooks alone: the op recorder cannot see inside
            a compiled block, so those bytes are not split by kind). An analytic profile prices only blocks
            compiled with ``{"recompute_pointwise": True}`` (see :func:`_kept_as_selective`); whole-block recompute
            then uses the non-reentrant checkpoint, which the compiler traces. A dict: compiled so, with these
            keyword arguments of ``compile_blocks`` (``{"recompute_pointwise": True}``, ``{"mode": ...}``), as the
            run will compile them; recorded in ``extra["compile_options"]``. A compiled profile leaves no compiled
            code behind: it ends with ``torch.compiler.reset()``, so the planned run compiles its own graphs as a
            fresh process would (one that reused the profile's died with an illegal memory access on CUDA, a
            Hugging Face Llama, ``BENCHMARKS.md`` twenty-second session). Functions the caller compiled before
            recompile on their next call.

    Returns:
        The :class:`Profile`.

    Raises:
        ValueError: on an unknown source, a measured profile of a meta model, blocks already wrapped by
            elbowroom or compiled by ``compile_blocks``, a dict batch without a loss, or ``compiled`` on an analytic
            profile.
        TypeError: on a sample batch of another form.
    """
    if source not in ("auto", "measured", "analytic"):
        raise ValueError(f"source must be 'auto', 'measured' or 'analytic', got {source!r}")
    device = _model_device(model)
    if source == "auto":
        source = "analytic" if device.type == "meta" else "measured"
    if source == "measured" and device.type == "meta":
        raise ValueError("a model on the meta device has no data to measure: use source='analytic'")
    if source == "analytic" and device.type != "meta":
        # trace a copy whose parameters and buffers are meta tensors: the model's own data is neither copied
        # nor touched (a model too big for any device should be built on meta in the first place)
        if blocks is not None and not isinstance(blocks, str):
            raise ValueError("source='analytic' on a model that is not on the meta device needs blocks= as a dotted "
                             "path (the modules given would be the originals, not the traced copy)")
        model = meta_copy(model)
        device = torch.device("meta")
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    compile_options = dict(compiled) if isinstance(compiled, Mapping) else {}
    compiled = isinstance(compiled, Mapping) or bool(compiled)
    if compiled and source != "measured" and not compile_options.get("recompute_pointwise"):
        raise ValueError("compiled=True needs a measured profile: the analytic one prices eager blocks, and what "
                         "blocks compiled with the partitioner's defaults save only a measurement tells; "
                         "compiled={'recompute_pointwise': True}, as planned runs compile, is priced analytically")
    if compiled:
        reentrant = False  # (torch.compile traces the non-reentrant checkpoint only)
    block_list, block_path = _resolve_blocks(model, blocks)
    for b in block_list:
        if _wrap.get_policy(b) is not None:
            raise ValueError("profile the model before applying recompute or offload to its blocks "
                             "(elbowroom.activations.remove_activation_policy(model) undoes them)")
        if is_compiled(b):
            raise ValueError("profile the model before compiling its blocks: pass compiled=True to price them "
                             "compiled (elbowroom.activations.uncompile_blocks(blocks) undoes compile_blocks)")

    if machine is None:
        machine = measure_machine(device, cache_dir=cache_dir) if source == "measured" else get_device("h100-80gb")
    elif isinstance(machine, str):
        machine = get_device(machine)
    param_dtype = next(model.parameters()).dtype
    if dtype is None:
        gpu = device.type == "cuda" or (source == "analytic" and machine.name != "cpu")
        dtype = torch.bfloat16 if gpu else param_dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    autocast_dtype = dtype if dtype != param_dtype else None
    if autocast_dtype == torch.float32:
        raise ValueError(f"the parameters are {param_dtype} and autocast only lowers precision: profile with "
                         f"dtype={param_dtype} or cast the model to float32 first")
    target = "cuda" if (device.type == "cuda" or (device.type == "meta" and machine.name != "cpu")) else "cpu"

    batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, sample_batch)
    micro_batch, seq_len = _batch_shape(batch)
    step = _Step(model, batch, loss_fn)
    runner = _Runner(model, block_list, step, device, autocast_dtype, target,
                     reentrant_default() if reentrant is None else reentrant, compiled=compiled,
                     compile_options=compile_options)

    too_big = False
    with runner.preserved():
        try:
            plain = runner.trace(mode=None)
            selective = runner.trace(mode="selective")
            timings = runner.time_modes(warmup, iters) if source == "measured" else None
            as_compiled = runner.compiled_saved() if compiled and source == "measured" else None
        except torch.OutOfMemoryError:
            if source != "measured":
                raise
            too_big = True  # handled below, once the exception (and the step's tensors it holds) is gone
    if too_big:
        if compiled:
            logger.warning("profile: the plain step does not fit the device, so the blocks are priced eager "
                           "(compiled=True measures a plain compiled step)")
            runner.compiled = False  # (times and bytes alike)
        prof = _profile_recomputed(model, block_list, block_path, batch, loss_fn, runner, machine, micro_batch,
                                   seq_len, dtype, param_dtype, warmup, iters)
    else:
        prof = _assemble(
            model, block_list, block_path, plain, selective, timings, step.vocab, machine, source, micro_batch,
            seq_len, dtype, param_dtype, runner.allocator_overhead, runner.allocator_overhead_expandable,
            as_compiled,
        )
    if compiled and source == "analytic":  # see _kept_as_selective
        prof = dataclasses.replace(prof, blocks=[_kept_as_selective(b) for b in prof.blocks],
                                   extra={**prof.extra, "compiled_blocks": True, "compile_options": compile_options,
                                          "compiled_kept_as_selective": True})
    elif compiled:  # no compiled code of the profile's outlives it (see the docstring)
        torch.compiler.reset()
    if source == "measured":  # which checkpoint the recompute times are of, and whether the blocks ran compiled
        options = {"compile_options": compile_options} if compile_options and compiled and not too_big else {}
        prof = dataclasses.replace(prof, extra={**prof.extra, "reentrant_recompute": runner.reentrant,
                                                "compiled_blocks": compiled and not too_big, **options})
    return prof


def _kept_as_selective(block: BlockProfile) -> BlockProfile:
    """An analytic block as it runs compiled with pointwise recompute (``compile_blocks(recompute_pointwise=True)``,
    what planned runs compile with): kept whole, it saves what the eager trace's selective recompute keeps (the
    block's input and its matmul and attention outputs), the partitioner recomputing everything pointwise. Measured
    on CPU under bf16 autocast, a compiled block kept whole saved its selective bytes to 0.1% (Llama, ours and a
    Hugging Face one) and 0.3% (our GPT-2 block), and 6% more for a Hugging Face GPT-2 block with dropout (its masks);
    on an H200, W1's block 3.42 MB against 3.42 (``BENCHMARKS.md``, twenty-second session). Its times stay the
    analytic ones (efficient kernels: the backward reads the pointwise traffic already). Not split by kind: the
    hooks of a compiled block see one kind, as a measured compiled profile records it."""
    inp = int(block.saved_bytes.get("input", 0))
    saved = dict.fromkeys(block.saved_bytes, 0)
    saved.update(input=inp, pointwise=max(0, block.selective_saved_bytes - inp))
    sizes = tuple(x for x in (block.input_bytes, *block.kept_sizes) if x)
    return dataclasses.replace(block, saved_bytes=saved, saved_sizes=sizes,
                               largest_saved_bytes=max(sizes, default=0))


def _profile_recomputed(model: nn.Module, block_list: list[nn.Module], block_path: str, batch: Any,
                        loss_fn: LossFn | None, runner: _Runner, machine: MachineProfile, micro_batch: int,
                        seq_len: int, dtype: torch.dtype, param_dtype: torch.dtype, warmup: int,
                        iters: int) -> Profile:
    """The profile of a model whose unplanned step does not fit its device (the 7B shape on 80 GB).

    What each block saves is traced on a meta copy (the analytic profile's bytes, equal to a measured trace:
    ``tests/test_plan_profile.py``); the times are measured with every block fully recomputed, which needs only
    the blocks' inputs: forward as measured, backward as measured less one forward (the recompute), and the
    selective recompute priced from the trace's pointwise bytes as the analytic profile prices it. The allocator's
    overhead is not measured (the plan takes its margin as a fraction of the budget).
    """
    import gc

    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    logger.warning("the unplanned step does not fit %s: what the blocks save is traced on a meta copy, and the "
                   "times are measured with every block recomputed", machine.name)
    meta = meta_copy(model)
    meta_blocks, _ = _resolve_blocks(meta, block_path or None)
    meta_batch = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)
    meta_step = _Step(meta, meta_batch, loss_fn)
    meta_runner = _Runner(meta, meta_blocks, meta_step, torch.device("meta"), runner.autocast_dtype, runner.target)
    with meta_runner.preserved():
        plain = meta_runner.trace(mode=None)
        selective = meta_runner.trace(mode="selective")
    with runner.preserved():
        full = runner.time_modes(warmup, iters, modes=("full",))["full"]
    # a recomputed block's backward is its backward plus one forward: the plain backward is what is left (never
    # below zero, which a noisy measurement of a tiny block could give), and the recompute is the forward
    bwd = [max(0.0, b - f) for f, b in zip(full["fwd"], full["bwd"])]
    timings = {
        None: {"fwd": full["fwd"], "bwd": bwd,
               "total_fwd": full["total_fwd"], "total_bwd": max(0.0, full["total_bwd"] - sum(full["fwd"]))},
        "full": {**full, "bwd": [b + f for f, b in zip(full["fwd"], bwd)]},
    }
    prof = _assemble(model, block_list, block_path, plain, selective, timings, meta_step.vocab, machine, "measured",
                     micro_batch, seq_len, dtype, param_dtype, 0, 0)
    return dataclasses.replace(prof, extra={**prof.extra, "recomputed": True})  # no plain step was measured


class _Runner:
    """Runs traced and timed steps on the model, and puts it back as it was."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], step: _Step, device: torch.device,
                 autocast_dtype: torch.dtype | None, target: str, reentrant: bool = False,
                 compiled: bool = False, compile_options: dict[str, Any] | None = None) -> None:
        self.model, self.blocks, self.step, self.device = model, blocks, step, device
        self.reentrant = reentrant  # whole blocks recompute with torch's reentrant checkpoint
        self.compiled = compiled  # the timed steps (and compiled_saved) run the blocks compiled
        self.compile_options = compile_options or {}  # compile_blocks' keyword arguments
        self.autocast_dtype, self.target = autocast_dtype, target
        self.clock = Clock(device)
        self.allocator_overhead = 0
        self.allocator_overhead_expandable = 0

    @contextlib.contextmanager
    def preserved(self) -> Any:
        """Training mode on, and afterwards: flags, RNG, autocast cache setting restored, no grads, no wrappers."""
        model = self.model
        flags = [(m, m.training) for m in model.modules()]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        cache = torch.is_autocast_cache_enabled()
        if self.device.type == "meta":
            # elbowroom's checkpoint wrapper asks torch.is_autocast_enabled(x.device.type) when the autocast cache
            # is on, which raises for "meta"; the meta trace has no real autocast, so the cache is moot
            torch.set_autocast_cache_enabled(False)
        model.train()
        # a Hugging Face model builds a KV cache unless told, also under a caller's loss_fn, and a recomputed block
        # refuses to write it twice: off while profiling (plan.apply turns it off for training the same way)
        config = getattr(model, "config", None)
        use_cache = getattr(config, "use_cache", None)
        if use_cache:
            config.use_cache = False
        try:
            yield
        finally:
            if use_cache:
                config.use_cache = use_cache
            uncompile_blocks(self.blocks)
            for b in self.blocks:
                uncheckpoint(b)
            for m, t in flags:
                m.training = t
            torch.set_autocast_cache_enabled(cache)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
            model.zero_grad(set_to_none=True)

    def _state(self) -> set:
        return {skey(t) for t in list(self.model.parameters()) + list(self.model.buffers())}

    def _autocast(self) -> Any:
        if self.autocast_dtype is None or self.device.type == "meta":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _run(self, tracer: Tracer, record: bool, backward: bool = True) -> tuple[float, float]:
        """One forward (+ backward); returns the forward's and the backward's seconds, read after a sync.
        ``record``: the saved-tensor hooks, and the op recorder where the tracer records ops."""
        handles = tracer.install()
        try:
            with contextlib.ExitStack() as stack:
                if record:
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t))
                    if tracer.record_ops:
                        stack.enter_context(OpRecorder(tracer))
                if self.device.type == "meta":
                    stack.enter_context(MetaEmulation(self.autocast_dtype, self.target))
                t0 = self.clock.mark()
                with self._autocast():
                    loss = self.step()
                t1 = self.clock.mark()
                if not backward:
                    del loss  # frees the graph, and with it what the blocks saved
                    self.clock.sync()  # host-device sync: the events are read next
                    return self.clock.seconds(t0, t1), 0.0
                tracer.backward = True
                # not loss.backward(): under a TorchFunctionMode that call is itself intercepted, and the mode is
                # off while it runs, so the meta emulation would miss the recompute of checkpointed blocks
                torch.autograd.backward(loss)
                t2 = self.clock.mark()
        finally:
            for h in handles:
                h.remove()
        self.model.zero_grad(set_to_none=True)
        self.clock.sync()
        return self.clock.seconds(t0, t1), self.clock.seconds(t1, t2)

    def _apply(self, mode: str | None, compiled: bool = False) -> None:
        uncompile_blocks(self.blocks)
        for b in self.blocks:
            if mode is None:
                uncheckpoint(b)
            else:
                checkpoint(b, mode, use_reentrant=self.reentrant and mode == "full")
        if compiled:
            compile_blocks(self.model, blocks=self.blocks, **self.compile_options)

    def compiled_saved(self) -> dict[str | None, Tracer]:
        """What the compiled blocks save, kept whole (None) and under selective recompute: one step each with the
        saved-tensor hooks alone (after :meth:`time_modes`, whose warm-up compiled them)."""
        out: dict[str | None, Tracer] = {}
        for mode in (None, "selective"):
            self._apply(mode, compiled=True)
            try:
                out[mode] = tracer = Tracer(self.blocks, self._state(), self.clock, record_ops=False)
                self._run(tracer, record=True)
            finally:
                self._apply(None)
        return out

    def trace(self, mode: str | None) -> Tracer:
        """One recorded step, plain (None) or with every block under ``checkpoint(block, mode)``.

        Under a checkpoint only the forward runs: what the blocks keep is known when it ends, and on meta the
        recompute in backward would run outside the emulation (autograd does not carry torch function modes
        into backward).
        """
        self._apply(mode)
        try:
            tracer = Tracer(self.blocks, self._state(), self.clock, track_liveness=mode is not None)
            # on a real device the backward runs too: a checkpoint's cache of what it keeps is released by the
            # backward, and one left unread (a forward whose graph is dropped) outlives the step in a reference
            # cycle through autograd that Python's collector cannot break (W1: ~15 GiB held after profiling)
            self._run(tracer, record=True, backward=mode is None or self.device.type != "meta")
        finally:
            self._apply(None)
        return tracer

    def time_modes(self, warmup: int, iters: int,
                   modes: tuple[str | None, ...] = (None, "full", "selective")) -> dict[str | None, dict[str, Any]]:
        """Median per-block forward/backward seconds and step totals, plain, full and selective."""
        out: dict[str | None, dict[str, Any]] = {}
        cuda = self.device.type == "cuda"
        for mode in modes:
            fwd, bwd, tot_f, tot_b = self._time_mode(mode, warmup, iters)
            out[mode] = {"fwd": [_median(x) for x in fwd], "bwd": [_median(x) for x in bwd],
                         "total_fwd": _median(tot_f), "total_bwd": _median(tot_b)}
        if cuda and None in modes:
            self.allocator_overhead = self._overhead(expandable=False)
            self.allocator_overhead_expandable = self._overhead(expandable=True)
        return out

    def _time_mode(self, mode: str | None, warmup: int, iters: int
                   ) -> tuple[list[list[float]], list[list[float]], list[float], list[float]]:
        """Per-block forward and backward seconds and step totals of ``warmup + iters`` steps in ``mode`` (the
        warm-up ones left out)."""
        self._apply(mode, compiled=self.compiled)
        try:
            fwd: list[list[float]] = [[] for _ in self.blocks]
            bwd: list[list[float]] = [[] for _ in self.blocks]
            tot_f: list[float] = []
            tot_b: list[float] = []
            for it in range(warmup + iters):
                tracer = Tracer(self.blocks, set(), self.clock, record_ops=False)
                f, b = self._run(tracer, record=False)
                if it < warmup:
                    continue
                tot_f.append(f)
                tot_b.append(b)
                for i in range(len(self.blocks)):
                    r = tracer.regions[i]
                    fwd[i].append(self.clock.seconds(*r.fwd))
                    bwd[i].append(self.clock.seconds(*r.bwd))
        finally:
            self._apply(None)
        return fwd, bwd, tot_f, tot_b

    def _overhead(self, expandable: bool) -> int:
        """What the caching allocator holds beyond the tensors (reserved minus allocated) with
        ``expandable_segments`` set to ``expandable`` (switched for the measure and back, whatever the process runs),
        from an empty cache: the most over :data:`OVERHEAD_STEPS` plain steps and as many with every block under
        selective recompute, one after another as a run's steps follow each other. 0 when this torch cannot tell
        the setting or cannot switch it at run time, or when the steps run out of memory with it (the plan then
        prices the margin as a share of the budget).

        Why from an empty cache: with the setting already on, a step's reserved minus allocated counts every segment
        cached before it (the profile's own passes, an earlier run in the process); a Hugging Face Llama planned after
        a run whose plan had switched the setting on got a 13 GiB margin and a minimum of 19.2 GiB for a model that
        trains in 10.

        Why the selective steps: a plan's blocks run under policies, which recompute in the backward and free and
        make tensors in an order a plain step does not. On the 7B shape (H200, ``BENCHMARKS.md`` 2026-11-29
        twenty-fifth session) plain steps held 0.31 GiB beyond their allocated peak with expandable segments, steady
        from the first step, the same steps with every block selective 2.0 GiB, and the planned runs 3.7-5.0 GiB;
        the plain measure alone (0.28 GiB) left the 76 GiB plans at their cap, releasing and remapping the cache
        12-38 times in 10 steps. Measured this way the margin is 1.75 GiB and those plans retry 9-10 times: the
        rest of what a plan's mechanisms hold together is not modelled yet.

        Why both settings alike: the defaults measured on a plain step alone (0.35 GiB on the 7B), a plan for
        72.2 GiB chose them, held 5.7 GiB beyond its tensors by its sixteenth step and ran out of memory under a
        76 GiB cap (twenty-sixth session).
        """
        out_of_memory = False
        with expandable_segments(expandable) as on:
            if not on:
                return 0
            held = 1
            try:
                for mode in (None, "selective"):  # each from an empty cache, as a run's steps start from one
                    held = max(held, self._held_over_steps(mode))
            except torch.OutOfMemoryError:  # (handled once the exception and the tensors it holds are gone)
                out_of_memory = True
        if out_of_memory:  # the steps did not fit with this setting: unknown, priced as a share of the budget
            logger.warning("profile: the steps ran out of memory with expandable_segments:%s; the plan prices "
                           "that setting's allocator margin as a share of the budget", expandable)
            return 0
        return int(held)

    def _held_over_steps(self, mode: str | None) -> int:
        """Reserved minus allocated at the peak of :data:`OVERHEAD_STEPS` steps in ``mode`` from an empty cache."""
        self._apply(mode, compiled=self.compiled)
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            r0, a0 = torch.cuda.memory_reserved(self.device), torch.cuda.memory_allocated(self.device)
            for _ in range(OVERHEAD_STEPS):
                self._run(Tracer(self.blocks, set(), self.clock, record_ops=False), record=False)
                torch.cuda.synchronize(self.device)
            # what the steps' own allocations hold beyond their bytes: the segments made before the switch (the
            # profile's, partly free) are not the planned run's, whose allocations after apply() are all new
            # (GPT-2-XL planned with the setting: 0.4-0.9 GiB beyond allocated, where reserved minus allocated here
            # read 1.6 GiB)
            return ((torch.cuda.max_memory_reserved(self.device) - r0)
                    - (torch.cuda.max_memory_allocated(self.device) - a0))
        finally:
            self._apply(None)


def _kernel_seconds(ops: list[tuple], machine: MachineProfile) -> float:
    """The analytic time of a region's matmul and attention kernels (:mod:`elbowroom.plan.kernels`)."""
    return sum(kernels.seconds(k, machine) for k in ops)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _fused_chunk_tokens() -> int:
    from elbowroom.ops.linear_cross_entropy import linear_cross_entropy

    return int(inspect.signature(linear_cross_entropy).parameters["chunk_tokens"].default)


def _assemble(model: nn.Module, blocks: list[nn.Module], block_path: str, plain: Tracer, selective: Tracer,
              timings: dict | None, vocab: int, machine: MachineProfile, source: str, micro_batch: int,
              seq_len: int, dtype: torch.dtype, param_dtype: torch.dtype, allocator_overhead: int,
              allocator_overhead_expandable: int = 0, compiled: dict[str | None, Tracer] | None = None) -> Profile:
    """The profile from the traced steps (and the timed ones). ``compiled``: the bytes the compiled blocks save, kept
    whole (None) and selective, which replace the eager trace's per block (FLOPs, the head and the state stay the
    eager trace's)."""
    bw = machine.memory_bandwidth
    block_params = _unique_params(blocks)
    out_blocks = []
    for i, blk in enumerate(blocks):
        r, s = plain.regions[i], selective.regions[i]
        saved = {k: int(r.saved.get(k, 0)) for k in KINDS}
        sel_saved = int(sum(v for k, v in s.saved.items() if k in KINDS) + s.kept_alive)
        largest, sizes, kept_sizes = int(r.largest), tuple(r.sizes), tuple(s.kept_sizes)
        if compiled is not None:  # what the hooks saw: everything a compiled block saves, the kept outputs too
            rc, sc = compiled[None].regions[i], compiled["selective"].regions[i]
            saved = {k: int(rc.saved.get(k, 0)) for k in KINDS}
            sel_saved = int(sum(v for k, v in sc.saved.items() if k in KINDS))
            largest, sizes = int(rc.largest), tuple(rc.sizes)
            kept = list(sc.sizes)
            if sc.saved.get("input", 0) and sc.input_bytes in kept:
                kept.remove(sc.input_bytes)  # the cache's outputs alone, as the eager trace's kept_sizes
            kept_sizes = tuple(kept)
        params = _unique_params([blk])
        if timings is not None:
            fwd_s, bwd_s = timings[None]["fwd"][i], timings[None]["bwd"][i]

            # forward and backward: a checkpointed forward runs on the host through torch's checkpoint (and
            # selective's dispatch mode, every op in Python): on GPT-2-XL's small blocks that doubled the
            # selective forward, which the backward's difference alone left out (BENCHMARKS.md)
            def extra(mode: str, i: int = i, f: float = fwd_s, b: float = bwd_s) -> float:
                t = timings[mode]
                return max(0.0, t["fwd"][i] - f + t["bwd"][i] - b)

            rec_s = extra("full")
            if "selective" in timings:
                sel_s = extra("selective")
            else:  # not measured (a model whose plain step does not fit): its pointwise ops at memory speed
                sel_s = _POINTWISE_TRAFFIC * saved["pointwise"] / bw
        else:
            mem = _POINTWISE_TRAFFIC * saved["pointwise"] / bw
            fwd_s = _kernel_seconds(r.fwd_kernels, machine) + mem
            bwd_s = _kernel_seconds(r.bwd_kernels, machine) + 2 * mem
            rec_s, sel_s = fwd_s, mem
        out_blocks.append(BlockProfile(
            index=i, signature=_signature(blk), num_params=sum(p.numel() for p in params.values()),
            param_bytes=_nbytes(params), saved_bytes=saved, selective_saved_bytes=sel_saved,
            input_bytes=int(r.input_bytes), largest_saved_bytes=largest, forward_s=fwd_s, backward_s=bwd_s,
            recompute_s=rec_s, selective_recompute_s=sel_s, flops=r.fwd_flops + r.bwd_flops,
            saved_sizes=sizes, kept_sizes=kept_sizes,
        ))

    h = plain.regions[HEAD]
    model_params = _unique_params([model])  # in registration order, a tied weight at its first place
    head_params = {k: p for k, p in model_params.items() if k not in block_params}
    head_saved = int(sum(v for k, v in h.saved.items() if k in KINDS))
    tokens = micro_batch * seq_len
    c = _itemsize(dtype)
    # plain head: logits in the compute dtype, their fp32 upcast (none in fp32) and its fp32 gradient
    logits_transient = tokens * vocab * (c + (4 if c != 4 else 0) + 4)
    fused_transient = min(tokens, _fused_chunk_tokens()) * vocab * 4  # one chunk's fp32 logits
    if timings is not None:
        head_fwd = max(0.0, timings[None]["total_fwd"] - sum(b.forward_s for b in out_blocks))
        head_bwd = max(0.0, timings[None]["total_bwd"] - sum(b.backward_s for b in out_blocks))
    else:
        mem = _POINTWISE_TRAFFIC * h.saved.get("pointwise", 0) / bw
        head_fwd = _kernel_seconds(h.fwd_kernels, machine) + mem
        head_bwd = _kernel_seconds(h.bwd_kernels, machine) + 2 * mem
    # those registered after the last block's parameters (a weight tied to the embedding counts at the embedding)
    order = list(model_params)
    last = max((i for i, k in enumerate(order) if k in block_params), default=len(order))
    after_params = sum(head_params[k].numel() for k in order[last + 1:] if k in head_params)
    head = HeadProfile(
        num_params=sum(p.numel() for p in head_params.values()), param_bytes=_nbytes(head_params),
        after_params=after_params,
        saved_bytes=head_saved, logits_transient_bytes=int(logits_transient),
        fused_transient_bytes=int(fused_transient),
        fused_chunk_tokens=_fused_chunk_tokens(),
        forward_s=head_fwd, backward_s=head_bwd, flops=h.fwd_flops + h.bwd_flops,
    )
    extra = {
        "torch": torch.__version__,
        "vocab_size": vocab,
        "autocast": dtype != param_dtype,
        "state_saved_bytes": [int(plain.regions[i].saved.get("state", 0)) for i in range(len(blocks))],
        "shared_saved_bytes": [int(plain.regions[i].saved.get("shared", 0)) for i in range(len(blocks))],
        "forward_flops": [plain.regions[i].fwd_flops for i in range(len(blocks))],
        "head_state_saved_bytes": int(h.saved.get("state", 0)),
        "head_forward_flops": h.fwd_flops,
    }
    return Profile(
        source=source, machine=machine, micro_batch=micro_batch, seq_len=seq_len,
        compute_dtype=str(dtype).split(".")[-1],
        param_dtype=str(param_dtype).split(".")[-1], blocks=tuple(out_blocks), head=head, block_path=block_path,
        allocator_overhead_bytes=allocator_overhead, allocator_overhead_expandable_bytes=allocator_overhead_expandable,
        extra=extra,
    )

