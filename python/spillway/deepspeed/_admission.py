"""spillway.deepspeed's node admission at deepspeed.initialize: the rank learns its job from the
process group, the planner (offload/planner.h) sizes this rank's host need from the model and the
DeepSpeed config, and spillway.node.admit refuses, on every rank of the node alike, a job whose
ranks together pass the node budget. Private: the initialize hook (_boundary.py) runs it.
"""
import inspect
import json
import math
import os
import warnings

import torch

from .. import _spillway
from .. import node as _node
from ._audit import AuditWarning

_NODE_HINT = (
    "zero_optimization.offload_optimizer.device: nvme and offload_param.device: nvme, a smaller "
    "zero_optimization.reduce_bucket_size or sub_group_size, fewer ranks per node, or a larger node "
    "budget (SPILLWAY_NODE_BUDGET_BYTES, SPILLWAY_NODE_RESERVE_BYTES) where the node has the memory.")


def _ds_config(args, kwargs):
    config = kwargs.get("config", kwargs.get("config_params"))
    if config is None:
        ds_args = kwargs.get("args", args[0] if args else None)
        config = getattr(ds_args, "deepspeed_config", None)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    return config


def _plannable_json(config):
    """The DeepSpeed config as strict JSON for the planner. Clients put Python values in it that
    json.dumps writes as no JSON parser reads them: Accelerate sets steps_per_print to float('inf')
    (written "Infinity"). Non-finite numbers become null; the planner reads none of those keys."""
    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(config), allow_nan=False)


def _learn_job(original, args, kwargs):
    """Before admission: makes the process group as deepspeed.initialize would a few lines later
    (same backend, port and dist_init_required), so that a rank no launcher described learns its
    job and local rank from the group (spillway.node.learn_job; every rank does this, so it is
    collective like initialize itself). Where that fails, initialize meets the same error itself."""
    from deepspeed import comm as ds_comm  # noqa: PLC0415
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    signature = inspect.signature(original)
    params = signature.parameters
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return  # initialize raises it again, with DeepSpeed's words
    if "distributed_port" not in params or "dist_init_required" not in params:
        warnings.warn("spillway.deepspeed: this DeepSpeed's initialize takes no distributed_port or "
                      "dist_init_required, so a rank no launcher described does not learn its job before "
                      "admission here (spillway.node.learn_job() after init_process_group does)",
                      AuditWarning, stacklevel=3)
        return
    try:
        ds_comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                 distributed_port=bound.get("distributed_port", params["distributed_port"].default),
                                 dist_init_required=bound.get("dist_init_required"))
    except Exception:  # noqa: BLE001 (initialize makes the same call a few lines later and raises it there)
        return
    _node.learn_job()


def _admit(args, kwargs):
    """Node admission (spillway.node.admit) at deepspeed.initialize, before DeepSpeed allocates the
    offloaded state: this rank's host need comes from the planner (offload/planner.h) for the
    model's parameter count and the DeepSpeed config. Every rank of the node fails here with one
    message when their needs together pass the node budget."""
    if not _node.joined() or os.environ.get("SPILLWAY_NODE_ADMIT", "1") == "0":
        return
    ledger = _node.stats()
    if not ledger["local_world_size"]:
        warnings.warn("spillway.deepspeed: node admission skipped: the number of local ranks is not "
                      "known (set LOCAL_WORLD_SIZE, or start the ranks with torchrun, accelerate or "
                      "the deepspeed launcher)", AuditWarning, stacklevel=3)
        return
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    try:
        config = _ds_config(args, kwargs)
    except (OSError, ValueError) as e:  # hjson, base64: DeepSpeed reads it next and names what is wrong
        warnings.warn(f"spillway.deepspeed: node admission skipped: the DeepSpeed config cannot be read as "
                      f"JSON for the planner: {e}", AuditWarning, stacklevel=3)
        return
    if not isinstance(model, torch.nn.Module) or not isinstance(config, dict):
        warnings.warn("spillway.deepspeed: node admission skipped: deepspeed.initialize got no model "
                      "or no config dict to plan from", AuditWarning, stacklevel=3)
        return
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

    tensors = list(model.parameters())
    numels = [getattr(p, "ds_numel", 0) or p.numel() for p in tensors]
    params = sum(numels)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config_json = _plannable_json(config)
    except (TypeError, ValueError) as e:  # a value json cannot write (a client's object in the config)
        warnings.warn(f"spillway.deepspeed: node admission skipped: the DeepSpeed config cannot be written as "
                      f"JSON for the planner: {e}", AuditWarning, stacklevel=3)
        return
    # The room this job has: the budget less what the other jobs under the memory limit hold or
    # declared (admission counts them too), so the planner's suggestions are for what is left.
    others = sum(max(j["host_bytes"], j["declared_bytes"]) for j in ledger["jobs"] if j["name"] != ledger["job"])
    room = max(ledger["host_budget_bytes"] - others, 1 << 20)
    try:
        plan = _spillway._plan_deepspeed(float(params), world, max(world // ledger["local_world_size"], 1),
                                         room, config_json,
                                         get_accelerator().device_name() == "cpu",
                                         _node.anon_shared_bytes(), max(numels, default=0),
                                         any(hasattr(p, "ds_numel") for p in tensors))
    except _spillway.Error as e:
        warnings.warn(f"spillway.deepspeed: node admission skipped: the planner cannot read this run: {e}",
                      AuditWarning, stacklevel=3)
        return
    _node._planned["phases"] = plan["phases"]
    hint = "; ".join(plan["suggestions"])
    _node.admit(plan["host_per_rank"] + plan["fork_copy_per_rank"], plan["fork_copy_per_rank"],
               detail=f"Settings that would make it fit: {hint + '; ' if hint else ''}{_NODE_HINT}")
