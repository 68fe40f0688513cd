"""spillway.deepspeed's audit: which of DeepSpeed's offloaded host tensors live in Spillway's arenas,
run after deepspeed.initialize and after the first optimizer step. Public through spillway.deepspeed
(audit, offloaded_tensors, AuditWarning); this module is private.
"""
import warnings

import torch


class AuditWarning(UserWarning):
    """Some of DeepSpeed's offloaded host state is not in Spillway's arenas."""


def offloaded_tensors(engine):
    """(name, kind, tensor) for each host tensor of DeepSpeed's ZeRO-3 offloaded state that exists
    now: 16-bit partitions, fp32 master partitions and their gradients, the flat gradient
    partitions and the Adam moments. Storages shared by several names are listed once."""
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

    for g, buf in enumerate(getattr(opt, "param_groups_fp16_flat_cpu_memory", None) or ()):
        add(f"optimizer.param_groups_fp16_flat_cpu_memory[{g}]", "param", buf)
    module = getattr(engine, "module", None)
    for pname, p in (module.named_parameters() if module is not None else ()):
        add(f"{pname}.ds_tensor", "param", getattr(p, "ds_tensor", None))
    for i, fp32 in enumerate(getattr(opt, "fp32_partitioned_groups_flat", None) or ()):
        add(f"optimizer.fp32_partitioned_groups_flat[{i}]", "master_weight", fp32)
        add(f"optimizer.fp32_partitioned_groups_flat[{i}].grad", "grad", fp32.grad)
        inner = getattr(opt, "optimizer", None)
        state = getattr(inner, "state", {}).get(fp32, {}) if inner is not None else {}
        for key in ("exp_avg", "exp_avg_sq"):
            add(f"optimizer.optimizer.state[fp32[{i}]]['{key}']", "optimizer_state", state.get(key))
    add("optimizer.grad_partitions_flat_buffer", "grad", getattr(opt, "grad_partitions_flat_buffer", None))
    return found


def audit(engine):
    """Which of DeepSpeed's offloaded host tensors live in Spillway's arenas. Returns a dict:
    deepspeed (version), total_bytes, covered_bytes, by_kind ({kind: bytes}), missed (a list of
    {name, kind, bytes}), tensors (how many were looked at)."""
    import spillway  # noqa: PLC0415
    from .deepspeed import _deepspeed_version  # noqa: PLC0415

    runtime = spillway.installed()
    arenas = runtime.arenas if runtime is not None else ()
    report = {"deepspeed": _deepspeed_version(), "total_bytes": 0, "covered_bytes": 0, "by_kind": {},
              "missed": [], "tensors": 0}
    for name, kind, t in offloaded_tensors(engine):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        report["tensors"] += 1
        report["total_bytes"] += nbytes
        if any(a.contains(storage.data_ptr(), nbytes) for a in arenas):
            report["covered_bytes"] += nbytes
            report["by_kind"][kind] = report["by_kind"].get(kind, 0) + nbytes
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
            f"{report['total_bytes'] - report['covered_bytes']} of {report['total_bytes']} bytes of offloaded "
            f"state are not in Spillway's arenas: {names}{f' and {more} more' if more > 0 else ''}. Call "
            f"spillway.deepspeed.install() before the model is built and before deepspeed.initialize",
            AuditWarning, stacklevel=3)
    return report

