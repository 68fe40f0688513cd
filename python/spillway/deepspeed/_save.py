"""spillway.deepspeed.save_16bit_model: a ZeRO-3 engine's consolidated 16-bit weights streamed to
sharded safetensors one parameter at a time (docs/checkpoint.md). Public through spillway.deepspeed;
this module is private.
"""
import collections
import functools
import io
import math
import os
import pickle
import sys
import warnings

import torch

from .. import _spillway, _torch_allocators
from ._common import _defined, _Missing
from .. import safetensors_stream as st
from ._verified import _GATHER_VERIFIED  # the releases its multi-rank gather was verified on


def _consolidated_entries(engine, exclude_frozen_parameters):
    """(key, kind, tensor) in DeepSpeed's _zero3_consolidated_16bit_state_dict order: per
    module, its own parameters (a tied parameter under each of its names), then its persistent
    buffers, then its children."""
    out = []

    def walk(module, prefix):
        for name, p in module.named_parameters(recurse=False):
            if p is None or (exclude_frozen_parameters and not p.requires_grad):
                continue
            out.append((prefix + name, "param", p))
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in module._non_persistent_buffers_set:
                out.append((prefix + name, "buffer", b))
        for name, child in module.named_children():
            if child is not None:
                walk(child, prefix + name + ".")
    walk(engine.module, "")
    return out


def _full_shape(t):
    """A parameter's whole shape: ZeRO-3 keeps it in ds_shape while the tensor holds a partition."""
    return tuple(getattr(t, "ds_shape", t.shape))


def _check_streamable(engine, who):
    """Raises, on every rank alike and before any collective, where the streamed save cannot run."""
    if not engine.zero_optimization_partition_weights():
        raise _spillway.InvalidArgument(
            f"{who}: the engine is not ZeRO-3 (its weights are not "
            "partitioned); engine.module.state_dict() already holds them whole")
    reason = _unstreamable(engine)
    if reason is not None:
        import deepspeed  # noqa: PLC0415

        other = deepspeed.__version__ not in _GATHER_VERIFIED
        raise _spillway.FailedPrecondition(
            f"{who}: {reason}; nothing was written. Use engine.save_16bit_model"
            f"{', or DeepSpeed ' + ', '.join(_GATHER_VERIFIED) if other else ''}")


def save_16bit_model(engine, save_dir, max_shard_size=5 << 30, exclude_frozen_parameters=False,
                     block_size=1 << 20, queue_depth=8):
    """Writes a ZeRO-3 engine's 16-bit weights to `save_dir` as transformers-style sharded
    safetensors with model.safetensors.index.json: the tensors DeepSpeed's own
    engine.save_16bit_model would write, under the same names. Every rank must call it (the
    parameters are gathered collectively); rank 0 writes. One parameter is gathered at a time and
    streamed to its place in its shard through Spillway's aio_handle, so rank 0's host memory
    peaks at about one parameter, not the model (DeepSpeed gathers the whole state dict on rank 0
    first). Returns the files written on rank 0, [] elsewhere. Atomicity: see spillway.safetensors_stream.Writer.
    A failure on rank 0 (making the directory, a write, the commit) is raised on every rank once all
    have left the save's collectives: rank 0's own exception there, spillway.IoError elsewhere."""
    who = "spillway.deepspeed.save_16bit_model"
    _check_streamable(engine, who)
    entries = _consolidated_entries(engine, exclude_frozen_parameters)
    return _save_safetensors(engine, save_dir, entries, max_shard_size, who, block_size, queue_depth)


def _save_safetensors(engine, save_dir, entries, max_shard_size, who, block_size=1 << 20, queue_depth=8,
                      prepare=None):
    """`entries` ((key, kind, tensor), every rank the same) gathered one at a time into sharded
    safetensors in `save_dir`; a tied parameter is gathered again under each of its names (safetensors
    has no aliases). `prepare()`, if given, runs on rank 0 before its writer opens, inside the save's
    agreement: its failure is raised on every rank, as a failed open is."""
    layout = [(key, _full_shape(t), t.dtype) for key, _, t in entries]
    plan = st.Plan(layout, max_shard_size)

    def open_sink():
        if prepare is not None:
            prepare()
        return st.Writer(save_dir, plan, block_size, queue_depth)
    return _stream(engine, entries, open_sink, save_dir, who)


_streams = 0  # saves that reached _stream in this process (the tests read it)


def _stream(engine, entries, open_sink, where, who):
    """Gathers each of `entries` ((key, kind, tensor), the same list on every rank) in order, on every
    rank, and hands it to the sink rank 0 opens with `open_sink()` (write(key, tensor), commit() ->
    files, abort()). Returns commit()'s files on rank 0, [] elsewhere; a failure on rank 0 is raised
    on every rank once all have left the collectives."""
    import deepspeed  # noqa: PLC0415
    import deepspeed.comm as dist  # noqa: PLC0415

    global _streams
    _streams += 1
    rank0 = dist.get_rank() == 0
    # Rank 0 alone writes, and every rank gathers every parameter. A failure on rank 0 (the
    # directory, a write, the commit) is kept and raised after the last collective, on every rank:
    # leaving at once would strand the others in the next all-gather, and a caller that went on
    # would pair its next collective with theirs.
    writer, failure = None, None
    if rank0:
        try:
            writer = open_sink()
        except Exception as e:  # noqa: BLE001 (raised below, once every rank has agreed)
            failure = e

    def write(key, tensor):
        nonlocal failure
        if writer is None or failure is not None:
            return
        try:
            writer.write(key, tensor)
        except Exception as e:  # noqa: BLE001 (raised below, once every rank has agreed)
            failure = e

    try:
        # Under spillway.install(), each gathered parameter is a "checkpoint" allocation of the host
        # arena: exact size, and its pages are reused by the next one, where glibc's heap kept a
        # varying number of freed 2 MiB gathers resident (peaks of 15 to 31 MiB over an 8-step
        # 25M-parameter model, depending on the torch release).
        # Every rank must gather every parameter, so all of them agree first: the arena serves the
        # gathers only if each rank's budget has room for two of the largest (the gather and a
        # host copy of it); else torch's allocator does, on every rank. One rank refusing a gather
        # with OverBudget would leave the others waiting in the all-gather.
        import contextlib  # noqa: PLC0415
        from deepspeed.accelerator import get_accelerator  # noqa: PLC0415

        runtime = _torch_allocators.installed()
        room = 0
        if runtime is not None:
            s = runtime.host.stats()
            # The budget caps bytes held from the OS; empty retained regions are given back on demand.
            room = s["budget_bytes"] - s["committed_bytes"] + s["retained_bytes"]
        page = os.sysconf("SC_PAGE_SIZE")  # the arena's granule: each allocation rounds up to it
        largest = max((-(-math.prod(_full_shape(t)) * t.element_size() // page) * page
                       for _, _, t in entries), default=0)
        device = get_accelerator().current_device_name()
        agreed = torch.tensor([1 if runtime is not None and room >= 2 * largest else 0, failure is None],
                              dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        in_arena, ok = bool(agreed[0].item()), bool(agreed[1].item())

        def gathering():
            return _torch_allocators.tag("checkpoint") if in_arena else contextlib.nullcontext()

        files = []
        if ok:  # else rank 0 could not open its sink, and every rank knows: nothing to gather
            # As DeepSpeed's own gather: the optimizer's checkpoint prologue first (every parameter
            # partitioned), its epilogue after.
            if getattr(engine, "_optimizer_has_ckpt_event_prologue", lambda: False)():
                engine.optimizer.checkpoint_event_prologue()
            for key, kind, t in entries:
                if kind == "param" and hasattr(t, "ds_id"):
                    with gathering(), deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                        if rank0:
                            write(key, t.data)
                elif rank0:
                    write(key, t)
            if getattr(engine, "_optimizer_has_ckpt_event_epilogue", lambda: False)():
                engine.optimizer.checkpoint_event_epilogue()
            if rank0 and failure is None:
                try:
                    files = writer.commit()
                except Exception as e:  # noqa: BLE001 (raised below, once every rank has agreed)
                    failure = e
            # The last collective: every rank learns whether rank 0 committed.
            done = torch.tensor([failure is None], dtype=torch.int32, device=device)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            ok = bool(done.item())
        if failure is not None:
            raise failure
        if not ok:
            raise _spillway.IoError(
                f"{who}: rank 0 failed to write the checkpoint to {where} "
                "(rank 0 raised the cause); do not load it from there. Fix what rank 0 reports and save again")
        return files
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


# DeepSpeed's own format, streamed. engine.save_16bit_model writes torch.save(state_dict) on rank 0:
# a zip (torch's PyTorchFileWriter) whose records are data.pkl (the pickled OrderedDict, each tensor
# a _rebuild_tensor_v2 of a storage named by key), then .format_version, .storage_alignment and
# byteorder, then data/0, data/1, ... in key order. The pickle needs only shapes and dtypes, so it
# is written first and each storage is appended as its parameter is gathered, with no more than one
# parameter in memory. torch.load returns the dict DeepSpeed's file holds: the same names in the same
# order, equal tensors, a tied parameter one storage under both names. The files differ in bytes:
# one storage per tensor here, where DeepSpeed's may hold a tensor as a view into a larger buffer
# (on the CPU accelerator, gathered parameters are views of one flat buffer, and torch.save writes
# the whole buffer).

class _StorageRef:
    def __init__(self, key, dtype, numel):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    def __init__(self, storage, shape):
        self.storage, self.shape = storage, tuple(int(s) for s in shape)

    def __reduce__(self):
        stride, step = [], 1
        for n in reversed(self.shape):
            stride.append(step)
            step *= max(n, 1)
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, tuple(reversed(stride)), False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class TorchFile:
    """One torch.save file of an OrderedDict of tensors, planned from `entries` ((key, shape, dtype,
    tensor), where entries with the same `tensor` object share one storage) and written one storage
    at a time, in order, with write(key, tensor). commit() fsyncs and renames it over `path`
    (a temporary `path.tmp-<pid>` until then); abort() removes the temporary."""

    def __init__(self, path, entries):
        refs, self._order, storages = collections.OrderedDict(), [], {}
        for key, shape, dtype, tensor in entries:
            ref = storages.get(id(tensor))
            if ref is None:
                ref = storages[id(tensor)] = _StorageRef(str(len(storages)), dtype, math.prod(shape))
                self._order.append((key, tuple(shape), dtype))
            elif ref.dtype != dtype or ref.numel != math.prod(shape):
                raise ValueError(f"{key} aliases a tensor of another dtype or size")
            refs[key] = _TensorRef(ref, shape)
        buf = io.BytesIO()
        _Pickler(buf, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(refs)
        data = buf.getvalue()
        self.path, self._tmp, self._next = path, f"{path}.tmp-{os.getpid()}", 0
        self._zip = self._stream = None
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # As torch.save opens its file: its CRC32 option and storage alignment, and a Python file
        # for a name PyTorchFileWriter cannot take (it takes ASCII names only).
        alignment = torch.serialization._get_storage_alignment()
        crc = torch.serialization.get_crc32_options()
        try:
            if self._tmp.isascii():
                self._zip = torch._C.PyTorchFileWriter(self._tmp, crc, alignment)
            else:
                self._stream = open(self._tmp, "wb")  # noqa: SIM115 (closed by commit or abort)
                self._zip = torch._C.PyTorchFileWriter(self._stream, crc, alignment)
            self._record("data.pkl", data, len(data))
            for name, value in ((".format_version", "1"), (".storage_alignment", str(alignment)),
                                ("byteorder", sys.byteorder)):
                self._record(name, value, len(value))
        except BaseException:
            self.abort()
            raise

    def _record(self, name, data, size):
        try:
            self._zip.write_record(name, data, size)
        except Exception as e:  # noqa: BLE001 (torch's writer raises RuntimeError for an OS error)
            raise OSError(f"writing {name} ({size} bytes) to {self._tmp}: {e}") from e

    def write(self, key, tensor):
        """Appends the storage of `key`, which must be the next one planned (an alias of an earlier
        tensor has none of its own)."""
        if self._next >= len(self._order) or self._order[self._next][0] != key:
            expected = repr(self._order[self._next][0]) if self._next < len(self._order) else "none"
            raise ValueError(f"{key!r} is out of order: the file's next storage is {expected}")
        _, shape, dtype = self._order[self._next]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{key}: got {tensor.dtype} {tuple(tensor.shape)}, the plan says {dtype} {shape}")
        data = tensor.detach().to("cpu").contiguous()
        size = data.numel() * data.element_size()
        storage = data.untyped_storage()
        if data.storage_offset() != 0 or storage.nbytes() != size:  # a view into a larger buffer
            storage = data.clone().untyped_storage()
        self._record(f"data/{self._next}", storage, size)
        self._next += 1

    def commit(self):
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} planned tensors were never written, "
                             f"e.g. {self._order[self._next][0]}")
        try:
            self._zip.write_end_of_file()
        except Exception as e:  # noqa: BLE001 (as in _record)
            raise OSError(f"finishing {self._tmp}: {e}") from e
        self._zip = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        fd = os.open(self._tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self._tmp, self.path)
        st._fsync_directory(os.path.dirname(self.path) or ".")
        return [self.path]

    def abort(self):
        # Finished first: torch's writer finishes the archive in its destructor, and one whose write
        # failed throws there, which terminates the process. Finished here, it raises, and is dropped.
        try:
            if self._zip is not None:
                self._zip.write_end_of_file()
        except Exception:  # noqa: BLE001, S110 (the archive is being thrown away; the cause was raised)
            pass
        finally:
            self._zip = None
            if self._stream is not None:
                self._stream.close()
                self._stream = None
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass


class SaveWarning(UserWarning):
    """A save that Spillway would stream ran DeepSpeed's or transformers' own, gathering the model
    on rank 0; the message says why."""


_warned = set()


def _gives_way(call, owner, reason):
    """Says, once per call and reason in this process, that `call` runs its owner's own save."""
    if (call, reason) not in _warned:
        _warned.add((call, reason))
        warnings.warn(f"spillway.deepspeed: {call} runs {owner} own save, which gathers what it saves on rank 0 "
                      f"before writing it: {reason}", SaveWarning, stacklevel=3)


def _unstreamable(engine, writer=False):
    """Why gathering one parameter at a time cannot stand in for DeepSpeed's gather of the whole
    model on this engine (None: it can); with `writer`, also why it cannot stand in for the file
    DeepSpeed's save_16bit_model writes. The same answer on every rank."""
    import deepspeed  # noqa: PLC0415
    import deepspeed.comm as dist  # noqa: PLC0415
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # noqa: PLC0415

    from ._checkpoint import engine_class  # noqa: PLC0415

    if dist.get_world_size() > 1 and deepspeed.__version__ not in _GATHER_VERIFIED:
        return (f"on DeepSpeed {deepspeed.__version__} with {dist.get_world_size()} ranks, gathering one parameter "
                f"at a time was not verified (on 0.18.9 some gathered parameters held wrong values)")
    autotp = getattr(engine, "autotp_size", None)
    if autotp is not None and autotp() > 1:
        return (f"the engine is tensor-parallel (AutoTP size {autotp()}): each gathered parameter is one "
                "tensor-parallel shard, which DeepSpeed's own gather completes")
    if writer and type(getattr(engine, "checkpoint_engine", None)) not in (TorchCheckpointEngine, engine_class()):
        return (f"the engine's checkpoint engine is {type(engine.checkpoint_engine).__name__}, which writes "
                "the file itself")
    return None


def _unwritable(entries, codes, what):
    """Why `entries` cannot go into a file whose dtypes are `codes` (None: they can)."""
    for key, _, t in entries:
        if t.dtype not in codes:
            return f"{key} is {t.dtype}, which {what} has no code for"
    return None


def _standins(entries):
    """{key: one-element tensor}: two keys share a stand-in exactly where they are one parameter
    (tied), as the tensors of DeepSpeed's consolidated dict share a storage; the input of the name
    rules transformers and Accelerate apply to a state dict."""
    standins, state = {}, {}
    for key, kind, t in entries:
        state[key] = standins.setdefault(id(t), torch.empty(1)) if kind == "param" else torch.empty(1)
    return state


def _engine_save_16bit_model(original):
    @functools.wraps(original)
    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        if not (self.zero_optimization_partition_weights() and self.zero_gather_16bit_weights_on_model_save()):
            return original(self, save_dir, save_filename, exclude_frozen_parameters)
        entries = _consolidated_entries(self, exclude_frozen_parameters)
        reason = _unstreamable(self, writer=True) or \
            _unwritable(entries, torch.storage._dtype_to_storage_type_map(), "torch.save's storage types")
        if reason is not None:
            _gives_way("engine.save_16bit_model", "DeepSpeed's", reason)
            return original(self, save_dir, save_filename, exclude_frozen_parameters)
        check = getattr(self, "_raise_if_autoep_zero3_consolidated_export", None)
        if check is not None:
            check("save_16bit_model")
        seen, gathers, layout = set(), [], []
        for key, kind, t in entries:
            # Parameters tied across modules are one storage in DeepSpeed's dict; each buffer is a copy.
            layout.append((key, _full_shape(t), t.dtype, t if kind == "param" else object()))
            if kind != "param" or id(t) not in seen:  # a tied parameter: one storage, gathered once
                seen.add(id(t))
                gathers.append((key, kind, t))
        path = os.path.join(save_dir, save_filename)
        _stream(self, gathers, lambda: TorchFile(path, layout), path, "engine.save_16bit_model")
        return True
    save_16bit_model.__spillway_original__ = original
    return save_16bit_model


def _converts_weights(model, state):
    """Why transformers' save_pretrained would rename or merge `state`'s tensors on the way out (a
    weight conversion mapping, which only the whole dict can go through), or None."""
    from transformers import modeling_utils  # noqa: PLC0415

    revert = getattr(modeling_utils, "revert_weight_conversion", None)
    if revert is None:
        return None
    try:
        reverted = revert(model, dict(state))
    except Exception as e:  # noqa: BLE001 (a converter that needs real tensors: it converts)
        return f"its save_pretrained converts its weights on the way out ({type(e).__name__}: {e})"
    if set(reverted) != set(state) or any(reverted[k] is not v for k, v in state.items()):
        return "its save_pretrained renames or merges its weights on the way out (a weight conversion mapping)"
    return None


def _trainer_keys(model, entries):
    """(names, None): the names transformers' save_pretrained would write from DeepSpeed's
    consolidated dict of `model`, without _keys_to_ignore_on_save and without the tied aliases it
    drops (its own remove_tied_weights_from_state_dict, on stand-ins); or (None, why) where it
    would convert the weights."""
    from transformers import modeling_utils  # noqa: PLC0415

    state = _standins(entries)
    for ignored in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(ignored, None)
    state = modeling_utils.remove_tied_weights_from_state_dict(state, model)
    why = _converts_weights(model, state)
    return (None, why) if why else (set(state), None)


def _trainer_unstreamable(trainer, engine):
    """Why the Trainer's save_model cannot be streamed (None: it can). The same on every rank."""
    from transformers import PreTrainedModel  # noqa: PLC0415

    model = trainer.model
    if not isinstance(model, PreTrainedModel):
        return f"the model is a {type(model).__name__}, not a PreTrainedModel (a PEFT model saves its adapters)"
    if getattr(model, "_hf_peft_config_loaded", False):
        return "the model carries adapters (transformers' PEFT integration saves only them)"
    if getattr(model, "hf_quantizer", None) is not None:
        return "the model is quantized (its hf_quantizer serializes its own state)"
    if trainer.args.save_on_each_node:
        return "save_on_each_node is set (Spillway's save writes on global rank 0 only)"
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        return "transformers sharded the model at load time (its save gathers it its own way)"
    return _unstreamable(engine)


def _trainer_save_model(original):
    """transformers' Trainer.save_model (the final save, and the model half of every checkpoint it
    takes) under ZeRO-3 with stage3_gather_16bit_weights_on_model_save: the weights streamed to
    safetensors as save_pretrained names them, config, tokenizer and training arguments by the
    Trainer's own _save; else Trainer's own, with a SaveWarning naming why."""
    @functools.wraps(original)
    def save_model(self, output_dir=None, _internal_call=False):
        engine = getattr(self, "deepspeed", None) if getattr(self, "is_deepspeed_enabled", False) else None
        if engine is None or not engine.zero_optimization_partition_weights() or \
                not engine.zero_gather_16bit_weights_on_model_save():
            return original(self, output_dir, _internal_call)
        reason = _trainer_unstreamable(self, engine)
        entries = keys = None
        if reason is None:
            entries = _consolidated_entries(engine, False)
            keys, reason = _trainer_keys(self.model, entries)
        if reason is None:
            entries = [e for e in entries if e[0] in keys]
            reason = _unwritable(entries, st._DTYPES, "safetensors")
        if reason is not None:
            _gives_way("Trainer.save_model", "transformers'", reason)
            return original(self, output_dir, _internal_call)
        import inspect  # noqa: PLC0415

        from transformers.trainer_pt_utils import remove_dummy_checkpoint  # noqa: PLC0415
        from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME  # noqa: PLC0415

        output_dir = output_dir if output_dir is not None else self.args.output_dir

        def everything_but_the_weights():
            # transformers' own way (its fallback when the weights cannot be gathered): _save with
            # an empty state dict, then its empty weights file removed. On rank 0 (should_save,
            # save_on_each_node being off), inside the save's agreement: a failure here is raised
            # on every rank, and no rank is left in a gather.
            self._save(output_dir, state_dict={})
            remove_dummy_checkpoint(True, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])

        shard = inspect.signature(self.model.save_pretrained).parameters["max_shard_size"].default
        _save_safetensors(engine, output_dir, entries, st.parse_size(shard), "Trainer.save_model",
                          prepare=everything_but_the_weights)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
    save_model.__spillway_original__ = original
    return save_model


def _accelerate_save_model(original):
    """Accelerate's Accelerator.save_model of a ZeRO-3 engine (with
    stage3_gather_16bit_weights_on_model_save, safetensors): the weights streamed, under the names
    its own save keeps (clean_state_dict_for_safetensors drops tied aliases but the first); else
    Accelerate's own, which gathers the whole state dict on rank 0 through get_state_dict, with a
    SaveWarning naming why. A save_directory that is a file is refused on every rank (rank 0's
    writer cannot make it), where Accelerate logs an error and returns."""
    @functools.wraps(original)
    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: PLC0415

        if not isinstance(model, DeepSpeedEngine) or not model.zero_optimization_partition_weights() or \
                not model.zero_gather_16bit_weights_on_model_save():
            return original(self, model, save_directory, max_shard_size, safe_serialization)
        reason = _unstreamable(model)
        if reason is None and not safe_serialization:
            reason = "safe_serialization=False (torch .bin shards)"
        if reason is None and self.project_configuration.save_on_each_node:
            reason = "save_on_each_node is set (Spillway's save writes on global rank 0 only)"
        entries = None
        if reason is None:
            from accelerate.utils import clean_state_dict_for_safetensors  # noqa: PLC0415

            entries = _consolidated_entries(model, False)
            keys = set(clean_state_dict_for_safetensors(_standins(entries)))
            entries = [e for e in entries if e[0] in keys]
            reason = _unwritable(entries, st._DTYPES, "safetensors")
        if reason is not None:
            _gives_way("Accelerator.save_model", "Accelerate's", reason)
            return original(self, model, save_directory, max_shard_size, safe_serialization)
        _save_safetensors(model, save_directory, entries, st.parse_size(max_shard_size), "Accelerator.save_model")
    save_model.__spillway_original__ = original
    return save_model


def install(patch):
    """engine.save_16bit_model under ZeRO-3 streams DeepSpeed's format (TorchFile) instead of
    gathering the whole model on rank 0; transformers' Trainer.save_model and Accelerate's
    Accelerator.save_model too, once they are imported (install_clients)."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: PLC0415

    import deepspeed  # noqa: PLC0415

    patch(DeepSpeedEngine, "save_16bit_model", _engine_save_16bit_model(_defined(DeepSpeedEngine, "save_16bit_model")))
    install_clients(patch)
    initialize = _defined(deepspeed, "initialize")

    @functools.wraps(initialize)
    def initialize_and_patch_clients(*args, **kwargs):
        install_clients(patch)
        return initialize(*args, **kwargs)
    patch(deepspeed, "initialize", initialize_and_patch_clients)


_clients_left = set()  # the clients whose save_model install_clients found missing (warned once)


def install_clients(patch):
    """Trainer.save_model and Accelerator.save_model streamed, each once its module is imported and
    if not yet patched: called at install() and again at each deepspeed.initialize, which both call
    after their import."""
    for module, cls_name, wrap in (("transformers.trainer", "Trainer", _trainer_save_model),
                                   ("accelerate.accelerator", "Accelerator", _accelerate_save_model)):
        owner = sys.modules.get(module)
        cls = getattr(owner, cls_name, None) if owner is not None else None
        if cls is None or hasattr(cls.__dict__.get("save_model"), "__spillway_original__"):
            continue
        try:
            original = _defined(cls, "save_model")
        except _Missing:  # a release that moved it: its own save, said once
            if cls not in _clients_left:
                _clients_left.add(cls)
                warnings.warn(f"spillway.deepspeed: {module}.{cls_name}.save_model is not defined in this release "
                              f"(moved or renamed), so its final save stays its own and gathers the whole 16-bit "
                              f"model on rank 0; spillway.deepspeed.save_16bit_model(engine, dir) streams it",
                              SaveWarning, stacklevel=3)
            continue
        patch(cls, "save_model", wrap(original))
