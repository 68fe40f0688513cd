"""spillway.deepspeed's audit: which of DeepSpeed's offloaded host tensors live in Spillway's arenas,
run after deepspeed.initialize and after the first optimizer step, and the warnings that name, once
each, what a run turned on that stays DeepSpeed's. Public through spillway.deepspeed (audit,
offloaded_tensors, AuditWarning); this module is private.
"""
import functools
import warnings

import torch

from .. import _torch_allocators
from ._common import _deepspeed_version


class AuditWarning(UserWarning):
    """Some of DeepSpeed's offloaded host state is not in Spillway's arenas."""


def offloaded_tensors(engine):
    """(name, kind, tensor) for each host tensor of DeepSpeed's offloaded state that exists now, for
    the engine's ZeRO stage. ZeRO-3: 16-bit partitions, fp32 master partitions and their gradients,
    the flat gradient partitions and the Adam moments. ZeRO-1/2: the fp32 master partitions and
    their gradients, the 16-bit staging copies, the gradient staging and accumulation buffers, the
    Adam moments, and the flat 16-bit groups where they are on the CPU (the CPU accelerator's
    "device"). Storages shared by several names are listed once."""
    opt = getattr(engine, "optimizer", None)
    found, seen = [], set()

    def add(name, kind, t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            return
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return
        seen.add(key)
        found.append((name, kind, t))

    def moments(i, fp32, name):
        inner = getattr(opt, "optimizer", None)
        state = getattr(inner, "state", {}).get(fp32, {}) if inner is not None else {}
        for key in ("exp_avg", "exp_avg_sq"):
            add(f"optimizer.optimizer.state[{name}[{i}]]['{key}']", "optimizer_state", state.get(key))

    for g, buf in enumerate(getattr(opt, "param_groups_fp16_flat_cpu_memory", None) or ()):
        add(f"optimizer.param_groups_fp16_flat_cpu_memory[{g}]", "param", buf)
    module = getattr(engine, "module", None)
    for pname, p in (module.named_parameters() if module is not None else ()):
        add(f"{pname}.ds_tensor", "param", getattr(p, "ds_tensor", None))
    for i, fp32 in enumerate(getattr(opt, "fp32_partitioned_groups_flat", None) or ()):
        add(f"optimizer.fp32_partitioned_groups_flat[{i}]", "master_weight", fp32)
        add(f"optimizer.fp32_partitioned_groups_flat[{i}].grad", "grad", fp32.grad)
        moments(i, fp32, "fp32")
    add("optimizer.grad_partitions_flat_buffer", "grad", getattr(opt, "grad_partitions_flat_buffer", None))
    # ZeRO-1 and 2 (DeepSpeedZeroOptimizer).
    for i, fp32 in enumerate(getattr(opt, "single_partition_of_fp32_groups", None) or ()):
        add(f"optimizer.single_partition_of_fp32_groups[{i}]", "master_weight", fp32)
        add(f"optimizer.single_partition_of_fp32_groups[{i}].grad", "grad", fp32.grad)
        moments(i, fp32, "single_partition_of_fp32_groups")
    for i, buf in enumerate(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None) or ()):
        add(f"optimizer.param_buffer_of_bit16_for_cpu_offload_groups[{i}]", "param", buf)
    add("optimizer.temp_grad_buffer_for_cpu_offload", "grad", getattr(opt, "temp_grad_buffer_for_cpu_offload", None))
    for pid, buf in sorted((getattr(opt, "accumulated_grads_in_cpu", None) or {}).items()):
        add(f"optimizer.accumulated_grads_in_cpu[{pid}]", "grad", buf)
    for i, flat in enumerate(getattr(opt, "bit16_groups_flat", None) or ()):
        add(f"optimizer.bit16_groups_flat[{i}]", "param", flat)
    return found


def audit(engine):
    """Which of DeepSpeed's offloaded host tensors live in Spillway's arenas. Returns a dict:
    deepspeed (version), total_bytes, covered_bytes, by_kind ({kind: bytes}), missed (a list of
    {name, kind, bytes}), small_bytes (tensors below spillway.install's small_bytes, which stay
    torch's by design), tensors (how many were looked at)."""
    runtime = _torch_allocators.installed()
    arenas = runtime.arenas if runtime is not None else ()
    # Below the router's small_bytes a tagged allocation stays torch's by design (a page each would
    # waste more than it holds): such tensors are counted apart, not as missed.
    small = runtime.stats()["router"].get("small_bytes", 0) if runtime is not None else 0
    report = {"deepspeed": _deepspeed_version(), "total_bytes": 0, "covered_bytes": 0, "by_kind": {},
              "missed": [], "tensors": 0, "small_bytes": 0}
    for name, kind, t in offloaded_tensors(engine):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        report["tensors"] += 1
        report["total_bytes"] += nbytes
        if any(a.contains(storage.data_ptr(), nbytes) for a in arenas):
            report["covered_bytes"] += nbytes
            report["by_kind"][kind] = report["by_kind"].get(kind, 0) + nbytes
        elif nbytes < small:
            report["small_bytes"] += nbytes
        else:
            report["missed"].append({"name": name, "kind": kind, "bytes": nbytes})
    return report


def _audit_and_warn(engine, when):
    report = audit(engine)
    try:
        engine._spillway_audits = getattr(engine, "_spillway_audits", []) + [(when, report)]
    except AttributeError:
        pass
    if report["missed"]:
        names = "; ".join(f"{m['name']} ({m['kind']}, {m['bytes']} bytes)" for m in report["missed"][:16])
        more = len(report["missed"]) - 16
        warnings.warn(
            f"spillway.deepspeed audit {when}, DeepSpeed {report['deepspeed']}: "
            f"{sum(m['bytes'] for m in report['missed'])} of {report['total_bytes']} bytes of offloaded "
            f"state are not in Spillway's arenas: {names}{f' and {more} more' if more > 0 else ''}. Call "
            f"spillway.deepspeed.install() before the model is built and before deepspeed.initialize",
            AuditWarning, stacklevel=3)
    return report


# What a DeepSpeed config can turn on that stays DeepSpeed's under install(): (the setting, whether
# a config has it, what it means). Each is named once per process, at deepspeed.initialize. The
# table of every feature, covered or not, is in docs/deepspeed.md ("What stays DeepSpeed's").
_LEFT_SETTINGS = (
    ("aio.use_gds", lambda c: (c.get("aio") or {}).get("use_gds"),
     "DeepSpeed's swapper moves tensors between GPU memory and NVMe with GPUDirect Storage (GDSBuilder's "
     "gds_handle), not through Spillway's aio op, so those swap files are DeepSpeed's, outside Spillway's NVMe "
     "budget and metrics. Set aio.use_gds false for Spillway's io_uring op"),
    ("checkpoint.writer", lambda c: (c.get("checkpoint") or {}).get("writer") is not None,
     "DeepSpeed's FastPersist or decoupled checkpoint engine writes the checkpoints, not Spillway's: no "
     "manifest, no CRC32C check at load, `latest` written in place, loads read into new memory. Remove "
     "checkpoint.writer for Spillway's engine"),
    ("checkpoint.checkpoint_serialization: false", lambda c: (c.get("checkpoint") or {}).get(
        "checkpoint_serialization") is False,
     "it is not honoured: Spillway's checkpoint engine writes torch's zip format, which DeepSpeed, torch.load "
     "and zero_to_fp32 read as before and which its loads map instead of reading"),
)
_named_settings = set()


def _name_left_settings(config):
    """One AuditWarning per setting of _LEFT_SETTINGS the DeepSpeed config dict has (once per
    process), at deepspeed.initialize."""
    for setting, has, why in _LEFT_SETTINGS:
        if setting not in _named_settings and has(config):
            _named_settings.add(setting)
            warnings.warn(f"spillway.deepspeed: {setting} is set: {why}", AuditWarning, stacklevel=4)


def _name_left_engine_parts(engine, ours):
    """After deepspeed.initialize: a checkpoint engine that is not Spillway's (`ours`; FastPersist, the
    decoupled engine, DataStates) is named once; engine.offload_states() says, when first called,
    that what it moves leaves Spillway's arenas."""
    ckpt = getattr(engine, "checkpoint_engine", None)
    name = type(ckpt).__name__
    if ckpt is not None and not isinstance(ckpt, ours) and name not in _named_settings:
        _named_settings.add(name)
        warnings.warn(f"spillway.deepspeed: the checkpoint engine is DeepSpeed's {name}: its saves and loads stay "
                      "DeepSpeed's (no manifest, no CRC32C check at load, loads into new memory)",
                      AuditWarning, stacklevel=3)
    offload = getattr(engine, "offload_states", None)
    if offload is None or getattr(offload, "__spillway_original__", None) is not None:
        return

    @functools.wraps(offload)
    def offload_states(*args, **kwargs):
        if "offload_states" not in _named_settings:
            _named_settings.add("offload_states")
            warnings.warn("spillway.deepspeed: engine.offload_states() moves the state it offloads into new tensors "
                          "of torch's (pinned where pin_memory=True), outside Spillway's arenas, budget and fork "
                          "safety until engine.reload_states(); install()'s offload_optimizer: cpu keeps the "
                          "optimizer state in Spillway's arenas all along", AuditWarning, stacklevel=2)
        return offload(*args, **kwargs)
    offload_states.__spillway_original__ = offload
    engine.offload_states = offload_states
