"""The in-place forward wrapper that recompute and offload share.

A wrapped module keeps its class, parameters and ``state_dict`` keys; only the instance attribute
``forward`` is replaced by a bound method of :func:`_policy_forward`, which reads the module's
:class:`ModulePolicy`. One wrapper for both mechanisms fixes their order, whatever order the user
applied them in: the offload region is outside, the recomputed region inside, so the offload hooks
see what the checkpoint saves (its inputs) and never the tensors saved while recomputing.

Private: the public verbs are :func:`elbowroom.checkpoint`, :func:`elbowroom.activations.offload.offload_module`
and :func:`elbowroom.activations.apply_activation_policy`.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_ckpt
from torch.utils._pytree import tree_flatten, tree_unflatten

from elbowroom.activations import selective

_ATTR = "_elbowroom_policy"


@dataclass(frozen=True)
class RecomputeSpec:
    """How a module recomputes (see :func:`elbowroom.checkpoint`)."""

    mode: str
    """"full" or "selective"."""
    use_reentrant: bool
    """torch's reentrant implementation instead of the non-reentrant one."""
    preserve_rng_state: bool
    """Replay RNG exactly in the recompute."""
    policy: Callable[..., Any] | None
    """Selective-checkpoint policy; None for "full"."""
    determinism_check: str
    """torch's non-reentrant determinism check ("default" or "none")."""


@dataclass(frozen=True)
class OffloadSpec:
    """How a module offloads what its forward saves (see :func:`offload_module`)."""

    engine: Any
    """The :class:`~elbowroom.activations.offload.OffloadEngine` doing the copies."""
    ratio: float
    """Fraction of the bytes the saved-tensor hooks see (activations; a checkpointed block's inputs)."""
    cache_ratio: float
    """Fraction of the bytes a selective checkpoint keeps (matmul and attention outputs)."""
    tag: Hashable
    """Regions sharing a tag share one ratio measurement (haiscale semantics)."""


PREFETCH_LEAD_BLOCKS = 3
"""How many blocks ahead of its backward an offloaded block's tensors may start back (:class:`PrefetchChain`)."""


class PrefetchChain:
    """The offload regions of one model's blocks in the current forward, by block index.

    When backward reaches block ``i`` (the gradient of its output is ready), block ``i``'s own region is made sure of
    (what is still on the device stays there) and the nearest block before it whose region offloads starts
    travelling back, if it is at most ``lead`` blocks before: its copy runs under the backward of every block
    between. Blocks that offload nothing (kept whole, recomputed) therefore give the copies of the block before them
    their backward, as they gave them their forward (the engine waits for a region's copies only at the end of
    the next region that offloads). ``lead=1``: the previous block only.
    """

    def __init__(self, n: int, lead: int = PREFETCH_LEAD_BLOCKS) -> None:
        if not isinstance(lead, int) or isinstance(lead, bool) or lead < 1:
            raise ValueError(f"prefetch lead must be an int >= 1 (blocks), got {lead!r}")
        self.groups: list[Any] = [None] * n
        self.lead = lead

    def before(self, index: int) -> Any:
        """The region to bring back when backward reaches block ``index``: the nearest earlier one that offloads
        within the lead, or None."""
        for j in range(index - 1, max(index - 1 - self.lead, -1), -1):
            g = self.groups[j]
            if g is not None and (g.ratio > 0 or g.cache_ratio > 0):
                return g
        return None


class ModulePolicy:
    """Per-module settings read by the wrapped forward; stored in the module's ``__dict__``."""

    def __init__(self, orig_forward: Callable[..., Any] | None) -> None:
        self.orig_forward = orig_forward
        self.recompute: RecomputeSpec | None = None
        self.offload: OffloadSpec | None = None
        self.chain: PrefetchChain | None = None
        self.index = 0
        self.compiled_checkpoint: tuple[Callable[..., Any], RecomputeSpec] | None = None
        """A compiled checkpoint of ``orig_forward`` and the spec it was compiled for
        (:func:`~elbowroom.activations.compile_blocks`: a block recomputed whole, or selective and offloading what it
        keeps): run inside the offload region in place of the wrapper's own checkpoint, while ``recompute`` is still
        that spec."""

    def empty(self) -> bool:
        return self.recompute is None and self.offload is None and self.chain is None

    def active_compiled_checkpoint(self) -> Callable[..., Any] | None:
        """The compiled checkpoint the wrapper runs: ``compiled_checkpoint``'s function while ``recompute`` is still
        the spec it was compiled for, else None."""
        cc = self.compiled_checkpoint
        return cc[0] if cc is not None and cc[1] is self.recompute else None


def get_policy(module: nn.Module) -> ModulePolicy | None:
    """The module's policy, or None when it is not wrapped."""
    return module.__dict__.get(_ATTR)


def _ensure(module: nn.Module) -> ModulePolicy:
    pol = get_policy(module)
    if pol is None:
        # an instance-level forward set by someone before us is kept and called
        pol = ModulePolicy(module.__dict__.get("forward"))
        module.__dict__[_ATTR] = pol
        # a bound method of a module-level function: deepcopy rebinds it to the copy
        module.forward = types.MethodType(_policy_forward, module)
    return pol


def _release_if_empty(module: nn.Module) -> None:
    pol = get_policy(module)
    if pol is None or not pol.empty():
        return
    del module.__dict__[_ATTR]
    if pol.orig_forward is not None:
        module.forward = pol.orig_forward
    else:
        del module.__dict__["forward"]


def set_recompute(module: nn.Module, spec: RecomputeSpec | None) -> None:
    """Set (or clear, with None) how ``module`` recomputes."""
    _set(module, "recompute", spec)


def set_offload(module: nn.Module, spec: OffloadSpec | None) -> None:
    """Set (or clear, with None) how ``module`` offloads."""
    _set(module, "offload", spec)


def _set(module: nn.Module, what: str, spec: Any) -> None:
    if spec is not None:
        setattr(_ensure(module), what, spec)
        return
    pol = get_policy(module)
    if pol is not None:
        setattr(pol, what, None)
        _release_if_empty(module)


def set_chain(module: nn.Module, chain: PrefetchChain | None, index: int = 0) -> None:
    """Make ``module`` block ``index`` of a prefetch chain (or leave it, with None)."""
    if chain is None:
        if get_policy(module) is not None:
            get_policy(module).chain = None
            _release_if_empty(module)
        return
    pol = _ensure(module)
    pol.chain = chain
    pol.index = index


def _first_grad_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_grad_tensor(o)
            if t is not None:
                return t
    if isinstance(out, dict):
        for o in out.values():
            t = _first_grad_tensor(o)
            if t is not None:
                return t
    return None


def _prefetch_hook(*groups: Any) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        for g in groups:
            if g is not None:
                g.prefetch()

    return hook


def _policy_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    pol: ModulePolicy = self.__dict__[_ATTR]
    fn = pol.orig_forward if pol.orig_forward is not None else functools.partial(type(self).forward, self)
    rc = pol.recompute
    compiled = pol.active_compiled_checkpoint()
    if not torch.is_grad_enabled():
        # nothing is saved for backward: no recompute, no offload (a compiled checkpoint runs its forward alone)
        return (compiled or fn)(*args, **kwargs)
    if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
        # inside backward: an enclosing checkpoint is recomputing this module. Its hooks must see what
        # is saved here, so no offload region; a nested checkpoint is fine (torch supports nesting)
        return fn(*args, **kwargs) if rc is None else _checkpointed(fn, rc, None, args, kwargs)

    chain = pol.chain
    prev = chain.before(pol.index) if chain is not None else None
    off = pol.offload
    if compiled is not None and off is not None:
        # what the compiled checkpoint saves reaches the hooks as saved tensors: a full one's are its inputs (their
        # share: the input's), a selective one's its kept outputs too (the cache's share), under a tag of their own
        # (their sizes are the compiled graph's)
        share = off.cache_ratio if rc.mode == "selective" else off.ratio
        region = off.engine.group((off.tag, "compiled"), ratio=share, cache_ratio=share)
    elif off is not None:
        region = off.engine.group(off.tag, ratio=off.ratio, cache_ratio=off.cache_ratio)
    else:
        region = nullcontext()
    with region as group, _without_weight_cache(args, kwargs):
        if chain is not None:
            chain.groups[pol.index] = group
        if compiled is not None:
            if group is not None and off.ratio == 0 and rc.mode == "selective":
                group.keep_tensors(tree_flatten((args, kwargs))[0])  # the inputs stay, as the eager checkpoint's
            out = compiled(*args, **kwargs)
        else:
            out = fn(*args, **kwargs) if rc is None else _checkpointed(fn, rc, group, args, kwargs)
    own = group if group is not None and (group.ratio > 0 or group.cache_ratio > 0) else None
    if prev is not None or own is not None:
        t = _first_grad_tensor(out)
        if t is not None:
            # fires when backward reaches this block: this block's tensors still on the device stay there (before
            # anything polls them away), and the previous offloading block's tensors start back now, so that
            # their host-to-device copy runs under the backward of this block and of those between
            t.register_hook(_prefetch_hook(own, prev))
    return out


def _without_weight_cache(args: tuple, kwargs: dict) -> Any:
    """Autocast with its weight cache off for this block, when autocast is on for the block's device.

    Autocast keeps the low-precision copy of every weight it casts until the outermost autocast region
    exits, that is to the end of forward (W1: 2.5 GiB in bf16). A recomputed block casts again in backward and
    an offload region drops saved casts (see ``recast_parameter_casts``), so that cache holds memory for
    nothing: each weight is cast once per forward either way. Same dtype, same casts, same numerics.
    """
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if x is None or not torch.is_autocast_cache_enabled():
        return nullcontext()
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return nullcontext()
    return torch.autocast(dev, dtype=torch.get_autocast_dtype(dev), cache_enabled=False)


# names torch's checkpoint() takes for itself: a module keyword of one of these names is bound, not passed
_CHECKPOINT_OWN_KWARGS = frozenset(("use_reentrant", "context_fn", "determinism_check", "debug", "early_stop",
                                    "preserve_rng_state"))
# the keywords under which Hugging Face layers receive their KV cache (by transformers version and model)
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def _kv_cache_in_use(args: tuple, kwargs: dict) -> str | None:
    """What makes this call write a KV cache (a Hugging Face layer's ``use_cache`` / ``past_key_values``), or None.

    A cache is duck-typed (``get_seq_length`` and ``update``, transformers' ``Cache`` API) so that elbowroom
    does not import transformers; GPT-2's block receives it positionally.
    """
    if kwargs.get("use_cache") is True:
        return "use_cache=True"
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            return f"{name}={type(kwargs[name]).__name__}"
    for a in args:
        if hasattr(a, "get_seq_length") and hasattr(a, "update"):
            return f"a {type(a).__name__} argument"
    return None


def checkpointed_call(fn: Callable[..., Any], rc: RecomputeSpec, *args: Any, **kwargs: Any) -> Any:
    """``fn`` under ``rc``'s checkpoint with no offload region of its own: what :func:`compile_blocks` compiles for a
    block recomputed whole or selective and offloading (the region stays outside, eager)."""
    return _checkpointed(fn, rc, None, args, kwargs)


def _checkpointed(fn: Callable[..., Any], rc: RecomputeSpec, group: Any, args: tuple, kwargs: dict) -> Any:
    cache = _kv_cache_in_use(args, kwargs)
    if cache is not None:
        # the recompute runs the forward a second time, so a cache the forward writes would be written twice
        # (the keys of this step appended again, every later read wrong); dropping the cache for this layer
        # only would hand the caller a cache without it. HF turns use_cache off under gradient checkpointing.
        raise ValueError(
            f"a recomputed module was called with {cache}: its forward would write the KV cache again when "
            "backward recomputes it. Call the model with use_cache=False in training (or set "
            "model.config.use_cache = False); no-grad calls (generation) are not recomputed and may keep the cache"
        )
    if rc.use_reentrant:
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten((args, kwargs))[0]):
            return _checkpointed_reentrant(fn, rc, args, kwargs)
        # torch's reentrant checkpoint gives the module's parameters no gradient when none of its inputs needs
        # one (the first block after a frozen embedding): the non-reentrant one below does
    if _CHECKPOINT_OWN_KWARGS.intersection(kwargs):
        # torch's checkpoint() would take these for itself: bind them (non-reentrant recompute calls the
        # same closure, so bound tensors stay in the graph and get their gradients)
        fn, kwargs = functools.partial(fn, **kwargs), {}
    context_fn = torch_ckpt.noop_context_fn
    kept: list[selective.KeptOutputs] = []
    if rc.mode == "selective":
        context_fn = functools.partial(selective.selective_contexts, rc.policy, group, kept.append)
    extra: dict[str, Any] = {}
    if context_fn is not torch_ckpt.noop_context_fn:
        extra["context_fn"] = context_fn  # left out otherwise: torch.compile traces a checkpoint without one
    if rc.determinism_check != "default":
        extra["determinism_check"] = rc.determinism_check
    out = torch_ckpt.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=rc.preserve_rng_state, **extra, **kwargs
    )
    for k in kept:
        k.drop_unread_tail()
    return out


def _checkpointed_reentrant(fn: Callable[..., Any], rc: RecomputeSpec, args: tuple, kwargs: dict) -> Any:
    """torch's reentrant checkpoint, which takes positional tensors only, around ``fn(*args, **kwargs)``.

    Every tensor of the call, wherever it sits (a keyword, a tuple such as HF's ``position_embeddings=(cos,
    sin)``, a dict), becomes a positional input, so that the reentrant backward returns its gradient; the
    rest (flags, masks given as None, config objects) is bound. The recompute rebuilds the same call from
    the detached inputs.
    """
    if not kwargs and all(isinstance(a, torch.Tensor) or not _has_tensor(a) for a in args):
        return torch_ckpt.checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=rc.preserve_rng_state)
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in where]
    # the closure lives in the checkpoint's context until backward: it must not hold the tensors (that would
    # extend their lifetime past what the checkpoint saves, and an offload region could not free them)
    for i in where:
        leaves[i] = None

    def call(*inputs: torch.Tensor) -> Any:
        full = list(leaves)
        for i, t in zip(where, inputs):
            full[i] = t
        a, kw = tree_unflatten(full, spec)
        return fn(*a, **kw)

    return torch_ckpt.checkpoint(call, *tensors, use_reentrant=True, preserve_rng_state=rc.preserve_rng_state)


def _has_tensor(x: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(x)[0])
