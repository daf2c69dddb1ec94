"""The state_dict mapping: the inner optimizers' state in torch's layout, and back.

A ``CPUOffloadOptimizer`` steps with several inner torch optimizers (one per host bucket, one on the device),
each over its own tensors (host masters, device masters, or the parameters themselves). Its ``state_dict()``
is torch's layout over the user's parameters: ``state`` keyed by parameter index, ``param_groups`` as given,
so a checkpoint loads into this class at any offload fraction or into ``optimizer_class`` itself. Host state
stays on the CPU (a checkpoint of a 7B model does not pass through the device); with ``master_weights`` each
low-precision parameter's entry also holds its fp32 ``master_weight``.

Everything here runs on the training thread after the optimizer waited for its CPU steps (the inner state
belongs to the step thread while a step runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from elbowroom.optim import shards
from elbowroom.optim.placement import IMPL_KEYS, Placement

__all__ = ["add_master_weights", "link_state", "load_into", "owned", "shard_host_state"]


def owned(value: Any, device: torch.device) -> Any:
    """A tensor that already lives on ``device`` is copied; others are returned as they are.

    torch's ``Optimizer.load_state_dict`` keeps a state tensor that is already on the right device and
    dtype as it is (``value.to(...)`` returns ``value``): the loaded state would alias the source
    optimizer's, and two optimizers stepping on after a direct ``b.load_state_dict(a.state_dict())`` would
    both advance the same moments and step counts. (Tensors on another device are copied by torch anyway.)
    """
    if isinstance(value, torch.Tensor) and value.device == device:
        return value.clone()
    return value

def link_state(state: dict[torch.Tensor, Any], placement: Placement) -> None:
    """Point ``state[p]`` at the inner optimizers' state of each parameter (the same dicts, no copies).

    Args:
        state: the outer optimizer's ``state``.
        placement: where the parameters step.
    """
    for hp in placement.hps:
        st = hp.bucket.optimizer.state.get(hp.master)
        if st:
            state[hp.owner] = st
    if placement.dev_opt is not None:
        for p in placement.dev_params:
            st = placement.dev_opt.state.get(placement.dev_masters.get(p, p))
            if st:
                state[p] = st


def shard_host_state(sd: dict[str, Any], placement: Placement) -> None:
    """FSDP2: present the host state of each sharded parameter as ``DTensor``s laid out like the parameter, so
    that a distributed checkpoint saves every rank's shard and reshards on load (entries replaced, not edited).

    Args:
        sd: ``Optimizer.state_dict()`` of the outer optimizer.
        placement: where the parameters step.
    """
    for hp in placement.hps:
        if hp.index in sd["state"] and shards.is_sharded(hp.owner):
            shape = hp.param.shape
            sd["state"][hp.index] = {
                k: shards.as_sharded_like(v, hp.owner, shape) for k, v in sd["state"][hp.index].items()
            }


def add_master_weights(sd: dict[str, Any], param_groups: list[dict[str, Any]], placement: Placement) -> None:
    """Add each low-precision parameter's fp32 ``master_weight`` to its entry of torch's state dict.

    Args:
        sd: ``Optimizer.state_dict()`` of the outer optimizer (its entries are replaced, not edited).
        param_groups: the outer optimizer's groups.
        placement: where the masters live.
    """
    index = {id(p): i for i, p in enumerate(p for g in param_groups for p in g["params"])}
    masters = {id(hp.owner): hp.master for hp in placement.hps if not hp.same_dtype}
    masters.update({id(p): m for p, m in placement.dev_masters.items()})
    for pid, m in masters.items():
        i = index[pid]
        if i in sd["state"]:  # stepped at least once; before that the parameter is the master
            sd["state"][i] = {**sd["state"][i], "master_weight": m}


def load_into(
    state_dict: dict[str, Any],
    param_groups: list[dict[str, Any]],
    placement: Placement,
    hyper_of: Callable[[int], dict[str, Any]],
) -> None:
    """Load a state dict into the outer groups' hyperparameters and the inner optimizers, as copies.

    Args:
        state_dict: as saved by ``CPUOffloadOptimizer.state_dict`` or by ``optimizer_class``.
        param_groups: the outer optimizer's groups (their hyperparameters are updated).
        placement: where the parameters step.
        hyper_of: a user group's hyperparameters, after the update.

    Raises:
        ValueError: the state dict's groups do not match.
    """
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for g, sg in zip(param_groups, saved_groups):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
            )
    for g, sg in zip(param_groups, saved_groups):
        for k, v in sg.items():
            if k not in ("params", "param_names"):
                g[k] = v
    by_param: dict[torch.Tensor, dict[str, Any]] = {}
    for g, sg in zip(param_groups, saved_groups):
        for p, key in zip(g["params"], sg["params"]):
            if key in state_dict["state"]:
                by_param[p] = dict(state_dict["state"][key])

    def load_inner(
        opt: Optimizer,
        group_map: list[int],
        inner_of: Callable[[torch.Tensor], torch.Tensor],
        outer_of: dict[int, torch.Tensor],
    ) -> None:
        groups, state, k = [], {}, 0
        for inner, gi in zip(opt.param_groups, group_map):
            ids = []
            for m in inner["params"]:
                p = outer_of[id(m)]
                st = by_param.get(p)
                if st is not None:
                    mw = st.pop("master_weight", None)
                    if mw is not None and inner_of(p) is not p:
                        inner_of(p).copy_(mw)
                        hp = placement.hp_of.get(p)
                        if hp is not None:
                            hp.master_stale = False
                    if st:
                        # own copies: loading must not alias the source optimizer's state
                        inner_p = inner_of(p)
                        dev = inner_p.device
                        if not shards.is_sharded(inner_p):  # a host master steps the shard: its local part
                            st = {kk: shards.local(vv) if isinstance(vv, torch.Tensor) else vv for kk, vv in st.items()}
                        state[k] = {kk: owned(vv, dev) for kk, vv in st.items()}
                ids.append(k)
                k += 1
            keep = {kk: vv for kk, vv in inner.items() if kk in IMPL_KEYS and kk != "params"}
            groups.append({**hyper_of(gi), **keep, "params": ids})
        opt.state.clear()
        opt.load_state_dict({"state": state, "param_groups": groups})

    for hp in placement.hps:
        hp.master_stale = hp.same_dtype
    for b in placement.buckets:
        outer = {id(hp.master): hp.owner for hp in b.params}
        load_inner(b.optimizer, b.group_map, lambda p: placement.hp_of[p].master, outer)
    if placement.dev_opt is not None:
        outer = {id(placement.dev_masters.get(p, p)): p for p in placement.dev_params}
        load_inner(placement.dev_opt, placement.dev_group_map, lambda p: placement.dev_masters.get(p, p), outer)
