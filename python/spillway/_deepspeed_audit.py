"""spillway.deepspeed's audit: which of DeepSpeed's offloaded host tensors live in Spillway's arenas,
run after deepspeed.initialize and after the first optimizer step. Public through spillway.deepspeed
(audit, offloaded_tensors, AuditWarning); this module is private.
"""
import warnings

import torch

from . import _torch_allocators
from ._deepspeed_common import _deepspeed_version


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

