"""FSDP2's sharded model and optimizer in nmt's own checkpoint format, and back.

Under FSDP2 (`torch.distributed.fsdp.fully_shard`, accelerate's `fsdp_version: 2`) every parameter is a DTensor
holding this process's shard. nmt's checkpoints hold no pickle, and torch.distributed.checkpoint's sharded
format writes its `.metadata` with one, so a checkpoint under FSDP2 holds what a one-process run's does: the full
weights named as the bare model names them (a tied weight once) and the optimizer's state indexed as
`Optimizer.state_dict()` indexes it, gathered by every process (`get_model_state_dict` /
`get_optimizer_state_dict`, full_state_dict) and written by the main one. Any number of processes, under FSDP2
or DDP or alone, resumes from it: every process reads the full files and keeps its own shard
(`set_model_state_dict` / `set_optimizer_state_dict`). docs/results.md says why gathered rather than sharded
files (sizes and times measured at NLLB-600M's depth and half its width).
"""

from __future__ import annotations

import torch

# torch.distributed.checkpoint's state-dict functions are imported where they are used: half a second of modules
# (sympy among them) that a run without FSDP2 never needs

PREFIX = "model."  # the objective's name for the model: FSDP's state dicts keep it, nmt's files do not


def _first_names(objective: torch.nn.Module) -> dict[int, str]:
    """Each parameter (by id) -> its first name as `named_parameters` lists them (a tied one has several)."""
    first: dict[int, str] = {}
    for name, p in objective.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    return first


def _aliases(objective: torch.nn.Module) -> set[str]:
    """The second names of tied parameters: after the gather a tied weight comes back as two tensors, which nmt's
    files hold once, under the first name."""
    first = _first_names(objective)
    return {name for name, p in objective.named_parameters(remove_duplicate=False) if first[id(p)] != name}


def _order(objective: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters by name, in the order `Optimizer.state_dict()` numbers them."""
    first = _first_names(objective)
    return [first[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_weights(objective: torch.nn.Module, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """The sharded objective's full weights, named as the bare model's state_dict names them, a tied weight once:
    on the main process in CPU memory ({} on the others), or on every process on its device (`everywhere`: each
    then builds its own plain copy). Every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    state = get_model_state_dict(objective, options=options)
    aliases = _aliases(objective)
    return {k.removeprefix(PREFIX): v for k, v in state.items() if k not in aliases}


def full_optimizer_state(objective: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state on the main process ({} on the others), in `Optimizer.state_dict()`'s layout:
    parameters numbered in the order of its param_groups, as one process's optimizer numbers them. Every process
    must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(objective, optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not state:
        return {}
    index = {name: i for i, name in enumerate(_order(objective, optimizer))}
    groups, start = [], 0
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        end = start + len(group["params"])
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(start, end))})
        start = end
    return {"state": {index[name]: entry for name, entry in state["state"].items()}, "param_groups": groups}


def load_full_weights(objective: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Full weights as `full_weights` returns them (every process holds them all) into the sharded objective:
    each process keeps its shard. Names and shapes are checked first, a misfit raised as `load_state_dict` words
    it (a RuntimeError that `nmt.compat.state_dict_mismatch` reads)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    aliases = _aliases(objective)
    own = {k.removeprefix(PREFIX): v for k, v in objective.state_dict().items() if k not in aliases}
    for kind, names in (("Missing", [k for k in own if k not in weights]),
                        ("Unexpected", [k for k in weights if k not in own])):
        if names:
            raise RuntimeError(f"Error(s) in loading state_dict: {kind} key(s) in state_dict: "
                               + ", ".join(f'"{k}"' for k in names) + ".")
    for k, v in weights.items():
        if v.shape != own[k].shape:  # (a DTensor's shape is the whole tensor's)
            raise RuntimeError(f"size mismatch for {k}: copying a param with shape {v.shape} from checkpoint, the "
                               f"shape in current model is {own[k].shape}.")
    # the first name of a tied weight only: torch fills the parameter, which its other names share
    set_model_state_dict(objective, {PREFIX + k: v for k, v in weights.items()},
                         options=StateDictOptions(full_state_dict=True, strict=False))


def load_full_optimizer_state(objective: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """An optimizer state in `Optimizer.state_dict()`'s layout (`full_optimizer_state`, or a one-process run's)
    into the sharded optimizer; every process passes it whole and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    order = _order(objective, optimizer)
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in saved["param_groups"]]
    state = {order[i]: entry for i, entry in saved["state"].items()}
    set_optimizer_state_dict(objective, optimizer, {"state": state, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))
