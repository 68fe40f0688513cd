"""DeepSpeed's own engine.save_checkpoint / load_checkpoint after spillway.deepspeed.install()
(docs/deepspeed.md, Note [DeepSpeed checkpoints]): the files stay DeepSpeed's (torch.save's zip
format, the same names and contents), and

- each file is written to a temporary name with O_DIRECT through Spillway's aio op, double-buffered
  (_direct_file.py), fsynced and renamed into place, its CRC32C and length taken as torch.save
  writes it; at DeepSpeed's commit each rank writes a manifest of its files
  (spillway-checkpoint-rank<R>.json) and fsyncs the directory; `latest` is written after every
  rank committed, atomically (a temporary file renamed over it), so it never names a checkpoint
  that is not whole on disk;
- load_checkpoint first checks every file the tag's manifests list (length, then CRC32C; the ranks
  share the files and every rank learns what any found) and refuses a mismatch, naming each file,
  before anything of the engine changes; the files are then read with torch.load(mmap=True): their
  tensors are the page cache's pages, not a second anonymous copy of the state, and DeepSpeed
  copies them into its tensors; the Adam moments, which torch's Optimizer.load_state_dict would
  make the loaded tensors themselves, are copied into the moments that already exist (Spillway's
  arena), or into new ones tagged optimizer_state.

Private: spillway.deepspeed installs it.
"""
import contextlib
import ctypes
import errno
import glob
import json
import mmap
import os
import secrets
import shutil
import signal
import socket
import zipfile

import torch

from .. import _spillway, _torch_allocators
from ._common import _defined
from ._direct_file import DirectFiles
from .._log import logger
from ..safetensors_stream import _fsync_directory

MANIFEST = "spillway-checkpoint-rank{rank:05d}.json"
MANIFEST_FORMAT = "spillway-deepspeed-checkpoint/1"
_CHUNK = 8 << 20  # the read size when checking a file's CRC32C
# The fault seam of the tests: SIGKILL after this many files of one save are in place.
_KILL_AFTER_FILES = "SPILLWAY_TESTING_CHECKPOINT_KILL_AFTER_FILES"


def file_crc32c(path, buf, sync=False):
    """(bytes, CRC32C) of a file, read in chunks through `buf` (a writable buffer); with `sync`,
    the file is fsynced through the same descriptor."""
    crc, total = 0, 0
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            crc = _spillway.crc32c(view[:n], crc)
            total += n
        if sync:
            os.fsync(f.fileno())
    view.release()
    return total, crc


def _into_place(tmp, path, make):
    """make(tmp) writes and fsyncs `tmp`, which is then renamed to `path`; `tmp` is removed if any
    step fails (the error goes on). Returns what make returned."""
    try:
        result = make(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the first error is the one to report
            os.unlink(tmp)
        raise
    return result


def _replace_durably(tmp, path, write):
    """Writes `tmp` with write(file) through a buffered file, fsyncs it and renames it to `path`
    (_into_place)."""
    def make(name):
        with open(name, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        return result
    return _into_place(tmp, path, make)


def _temporary(path):
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.spillway-tmp-{os.getpid()}")


def _tag_of(info):
    # DeepSpeed 0.17 and later pass a CheckpointCommitInfo; earlier releases the tag itself.
    return str(getattr(info, "tag", info))


def _rank_and_world():
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def engine_class():
    """The checkpoint engine install() puts in place of DeepSpeed's TorchCheckpointEngine (made on
    first use: DeepSpeed is optional)."""
    global _ENGINE
    if _ENGINE is None:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # noqa: PLC0415

        class SpillwayCheckpointEngine(TorchCheckpointEngine):
            """DeepSpeed's torch.save / torch.load checkpoint engine with durable, checksummed
            files and loads that map the files instead of reading them into new memory. Inside
            engine.save_checkpoint (install()'s wrapper sets save_id) it keeps a manifest per rank
            and keeps failures for the wrapper to raise on every rank; elsewhere (DeepSpeed's
            save_16bit_model calls it too) a save raises at once and writes no manifest."""

            def __init__(self, config_params=None):
                super().__init__(config_params)
                self.name = "SpillwayCheckpointEngine"
                self.save_id = None  # set by the save_checkpoint wrapper while a save runs
                # checkpoint.use_node_local_storage: each node's ranks save into a directory of that
                # node's, which holds only their files and manifests.
                self.node_local = bool(getattr(config_params, "use_node_local_storage", False))
                self.failure = None  # (what, exception): the first failure of this save
                self._dir = None  # save_dir/tag of this save
                self._written = {}  # path relative to _dir -> {"bytes", "crc32c"}
                self._saved_files = 0
                self._direct = None  # DirectFiles of this process, made at the first file

            def create(self, info):
                super().create(info)
                self._written, self._saved_files, self.failure = {}, 0, None
                self._dir = None
                save_dir = getattr(info, "save_dir", None)
                if self.save_id is None or save_dir is None:
                    return
                # An in-progress manifest first, over any this rank wrote for an earlier save of
                # the same tag: a save of this rank killed or failed from here on leaves the tag
                # refused by the load, not loadable as a mix of two saves.
                self._dir = os.path.join(save_dir, _tag_of(info))
                self._keep(f"the manifest in {self._dir}", lambda: self._write_manifest(False))

            def _keep(self, what, fn):
                # Inside a save_checkpoint a failure is kept, not raised: the other ranks are on
                # their way to DeepSpeed's barrier at its end, and this rank leaving early would
                # leave them there. The wrapper raises it on every rank once all are out.
                if self.save_id is None:
                    return fn()
                if self.failure is not None:
                    return None
                try:
                    return fn()
                except Exception as e:  # noqa: BLE001 (raised by the wrapper on every rank)
                    self.failure = (what, e)
                    return None

            def _write_manifest(self, complete):
                rank, world = _rank_and_world()
                os.makedirs(self._dir, exist_ok=True)
                manifest = {"format": MANIFEST_FORMAT, "save_id": self.save_id, "rank": rank, "world_size": world,
                            "node_local": self.node_local, "complete": complete, "files": self._written}
                path = os.path.join(self._dir, MANIFEST.format(rank=rank))
                _replace_durably(_temporary(path), path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
                _fsync_directory(self._dir)

            def save(self, state_dict, path):
                self._keep(path, lambda: self._save(state_dict, path))

            def _save(self, state_dict, path):
                # Always torch's zip format (DeepSpeed's default; its checkpoint_serialization=false
                # asks for the legacy one, which torch.load cannot map).
                if self._direct is None or self._direct.pid != os.getpid():
                    self._direct = DirectFiles()
                w = _into_place(_temporary(path), path,
                                lambda tmp: self._direct.write(tmp, lambda writer: torch.save(state_dict, writer), path))
                if self._dir is not None:
                    self._written[os.path.relpath(path, self._dir)] = {"bytes": w.bytes, "crc32c": w.crc}
                self._saved_files += 1
                kill_after = os.environ.get(_KILL_AFTER_FILES)
                if kill_after is not None and self._saved_files >= int(kill_after):
                    os.kill(os.getpid(), signal.SIGKILL)

            def load(self, path, map_location=None):
                return load_file(path, map_location)

            def commit(self, info):
                super().commit(info)
                if self._dir is not None and self.failure is None:
                    copy = os.path.join(self._dir, "offloaded_tensors", self._swap_rank_dir())
                    self._keep(f"the swap folder's copy in {copy}", lambda: self._take_swap_copy(copy))
                    self._keep(f"the manifest in {self._dir}", lambda: self._write_manifest(True))
                return self.failure is None

            def _swap_rank_dir(self):
                # ZeRO-Infinity: DeepSpeed's save_checkpoint copies the optimizer's swap folder
                # into offloaded_tensors/rankNN of the tag (its local rank with node-local storage),
                # after the files and before this commit.
                rank = int(os.environ.get("LOCAL_RANK", "0")) if self.node_local else _rank_and_world()[0]
                return f"rank{rank:0>2d}"

            def _take_swap_copy(self, copy):
                """Fsyncs the files of this rank's swap-folder copy and lists them, with their
                CRC32C, in the manifest: DeepSpeed's copytree neither syncs nor checks them."""
                if not os.path.isdir(copy):
                    return
                with mmap.mmap(-1, _CHUNK) as buf:
                    for d, _dirs, files in os.walk(copy):
                        for name in sorted(files):
                            path = os.path.join(d, name)
                            size, crc = file_crc32c(path, buf, sync=True)
                            self._written[os.path.relpath(path, self._dir)] = {"bytes": size, "crc32c": crc}
                        _fsync_directory(d)
                _fsync_directory(os.path.dirname(copy))

        _ENGINE = SpillwayCheckpointEngine
    return _ENGINE


_ENGINE = None


def load_file(path, map_location=None):
    """torch.load of one of DeepSpeed's checkpoint files, mapped (its tensors are the file's pages
    until copied) where the file is in torch's zip format; a legacy-format file (DeepSpeed with
    checkpoint_serialization false) cannot be mapped and is read whole, which is logged."""
    with open(path, "rb") as f:  # a missing file raises here, as torch.load would
        mappable = zipfile.is_zipfile(f)
    if mappable:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=True)
    logger.info("spillway.deepspeed: %s is in torch's legacy format (written with checkpoint_serialization "
                "false): torch.load reads it whole into memory", path)
    return torch.load(path, map_location=map_location, weights_only=False)


def _sharers(directory, node_local):
    """The ranks that see `directory` as this one does, this rank among them, in order: with
    node-local storage those of this host where it is the same directory (device and inode: tests
    give each rank of one host a "node" directory of its own); else every rank (shared storage:
    one directory for all, whose device numbers differ between NFS clients). Every rank must call
    it with the same `node_local` (the engine's config)."""
    rank, world = _rank_and_world()
    if not node_local:
        return list(range(world))
    try:
        st = os.stat(directory)
        key = (socket.gethostname(), st.st_dev, st.st_ino)
    except OSError:
        key = None
    keys = _gather(key)
    return [r for r, k in enumerate(keys) if r == rank or (key is not None and k == key)]


def verify(load_dir, tag, node_local=False):
    """Checks load_dir/tag against its manifests, the files divided among the ranks that share the
    directory, and raises ChecksumMismatch on every rank naming what is wrong: a listed file
    missing, of another length or another CRC32C; a manifest that cannot be read, of another save,
    or of a rank whose part of the save did not finish (in progress, or absent). With node-local
    storage (`node_local`, the engine's config) each directory holds its ranks' parts, and the
    directories together must hold every rank's part of one save. Every rank must call it. Returns
    how many files were listed (0: no manifest, a checkpoint plain DeepSpeed wrote)."""
    directory = os.path.join(load_dir, str(tag))
    entries, problems, found = [], [], ([], [], 0)
    sharers = _sharers(directory, node_local)
    try:
        found = _check(directory, entries, problems, sharers, node_local)
    except Exception as e:  # noqa: BLE001 (reported on every rank below, after the exchange)
        problems.append(f"{directory}: checking it failed ({type(e).__name__}: {e})")
    everyone = _gather((problems, found))
    problems = [p for found_there, _ in everyone for p in found_there]
    if node_local:  # the directories of every node together: one save, every rank's part
        saves = {i for _, (ids, _r, _w) in everyone for i in ids}
        present = {r for _, (_i, ranks, _w) in everyone for r in ranks}
        world = max(w for _, (_i, _r, w) in everyone)
        if len(saves) > 1:
            problems.append(f"the node-local directories of {load_dir} hold {len(saves)} different saves of tag "
                            f"{tag} (a save that finished on some nodes only)")
        if saves and present != set(range(world)):
            problems.append(f"no node's {directory} holds the part of rank "
                            f"{', '.join(map(str, sorted(set(range(world)) - present)))} of the {world}-rank save")
    if problems:
        raise _spillway.ChecksumMismatch(
            f"spillway.deepspeed: load_checkpoint({load_dir!r}, tag={str(tag)!r}) refused, nothing of the engine "
            f"was changed: {'; '.join(problems)}. Load another tag (each is a directory of {load_dir}), or "
            "save this one again")
    return len(entries)


def _check(directory, entries, problems, sharers, node_local):
    """verify()'s own part on this rank: appends the listed files to `entries` and what is wrong to
    `problems`. `sharers`: the ranks that see this directory (this one among them), which divide
    its files between them. Returns (save ids, ranks, world size) of the manifests it read."""
    manifests = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), MANIFEST.replace("{rank:05d}", "*")))):
        try:
            with open(path, "rb") as f:
                m = json.load(f)
            if m.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {m.get('format')!r}, not {MANIFEST_FORMAT!r}")
            files = [(name, int(e["bytes"]), int(e["crc32c"])) for name, e in m["files"].items()]
            manifests[path] = (int(m["rank"]), int(m["world_size"]), str(m["save_id"]), bool(m["complete"]))
            entries += files
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{path}: cannot be read as a manifest ({e})")
    if not manifests:
        return [], [], 0
    worlds = {w for _r, w, _i, _c in manifests.values()}
    saves = {i for _r, _w, i, _c in manifests.values()}
    if len(worlds) > 1 or len(saves) > 1:
        problems.append(f"{directory}: its manifests are of {len(saves)} different saves, not of one")
    unfinished = sorted(r for r, _w, _i, complete in manifests.values() if not complete)
    world = max(worlds)
    # Node-local storage: this directory holds the parts of the ranks of this node only.
    expected = set(sharers) if node_local else set(range(world))
    present = {r for r, _w, _i, _c in manifests.values()}
    absent = sorted(expected - present)
    if unfinished or absent:
        problems.append(f"{directory}: the part of the {world}-rank save of rank "
                        f"{', '.join(map(str, sorted(unfinished + absent)))} did not finish (killed or failed: "
                        f"{'its manifest says in progress' if unfinished else 'no manifest'})")
    mine, ranks = sharers.index(_rank_and_world()[0]), len(sharers)
    # One anonymous mapping for the reads, unmapped after: a buffer from the heap would leave the
    # heap's top that much higher (glibc raises its mmap threshold after the first such free).
    with mmap.mmap(-1, _CHUNK) as buf:
        for i, (name, size, crc) in enumerate(sorted(entries)):
            if i % ranks != mine:
                continue
            path = os.path.join(directory, name)
            try:
                got_size, got_crc = file_crc32c(path, buf)
            except FileNotFoundError:
                problems.append(f"{path}: missing (the manifest lists it, {size} bytes)")
                continue
            except OSError as e:
                problems.append(f"{path}: cannot be read ({e})")
                continue
            if got_size != size:
                problems.append(f"{path}: {got_size} bytes where the manifest says {size} (truncated or "
                                "rewritten since the save)")
            elif got_crc != crc:
                problems.append(f"{path}: CRC32C {got_crc:#010x} where the manifest says {crc:#010x} (its "
                                "bytes changed since the save)")
    return sorted(saves), sorted(present), world


@contextlib.contextmanager
def state_in_place(basic):
    """While the block runs, torch's Optimizer.load_state_dict on `basic` (DeepSpeed's host
    optimizer) copies each loaded state tensor into the one the optimizer already has (same shape
    and dtype), or into a new tensor tagged optimizer_state, instead of keeping the loaded one."""
    if not isinstance(basic, torch.optim.Optimizer):
        yield
        return
    kept = {}

    def before(opt, state_dict):
        kept.update({p: dict(s) for p, s in opt.state.items()})

    def after(opt):
        for p, s in opt.state.items():
            old = kept.get(p, {})
            for key, v in list(s.items()):
                if not isinstance(v, torch.Tensor) or v.device.type != "cpu":
                    continue
                o = old.get(key)
                if (isinstance(o, torch.Tensor) and o is not v and o.shape == v.shape and o.dtype == v.dtype
                        and o.device == v.device):
                    o.copy_(v)
                    s[key] = o
                    continue
                tagged = (_torch_allocators.tag("optimizer_state") if _torch_allocators.installed()
                          else contextlib.nullcontext())
                with tagged:
                    fresh = torch.empty_like(v, memory_format=torch.contiguous_format)
                fresh.copy_(v)
                s[key] = fresh
        kept.clear()

    hooks = (basic.register_load_state_dict_pre_hook(before), basic.register_load_state_dict_post_hook(after))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        kept.clear()


_STAGING = ".spillway-saving-"  # tag + this + save id: a tag's directory while it is saved again
_RENAME_EXCHANGE = 2  # linux/fs.h


def _holds_a_save(directory):
    """True when `directory` holds a checkpoint's files (a manifest, or a file DeepSpeed names
    *.pt): what a save of its tag must not destroy before it is whole."""
    try:
        with os.scandir(directory) as it:
            return any(e.name.startswith("spillway-checkpoint-rank") or (e.name.endswith(".pt") and e.is_file())
                       for e in it)
    except OSError:
        return False


def _exchange(a, b):
    """Swaps the directory entries `a` and `b` in one step (renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")


def _remove_staged(save_dir, tag, node_local):
    """Removes what a killed save of `tag` left staged (by the first rank of each directory)."""
    first = min(_sharers(save_dir, node_local)) == _rank_and_world()[0]
    if first:
        for path in glob.glob(os.path.join(glob.escape(save_dir), glob.escape(tag) + _STAGING + "*")):
            shutil.rmtree(path, ignore_errors=True)
    _gather(None)  # none saves into save_dir before they are gone


def _swap_in(save_dir, staged, tag, node_local):
    """Puts a whole save made in save_dir/staged in place of save_dir/tag, in every directory (by
    its first rank: rank 0 on shared storage): one renameat2 RENAME_EXCHANGE, the directory fsynced,
    then the previous copy removed. Where the file system has no RENAME_EXCHANGE (NFS, older
    kernels), two renames, logged: a kill between them leaves the previous copy aside under its
    own name. Raises IoError on every rank when any failed, saying where each copy is."""
    failure, state = None, "staged"
    final, made = os.path.join(save_dir, tag), os.path.join(save_dir, staged)
    aside = final + ".spillway-previous"
    if min(_sharers(save_dir, node_local)) == _rank_and_world()[0]:
        try:
            if not os.path.isdir(final):  # this directory had no copy of the tag
                os.rename(made, final)
            else:
                try:
                    _exchange(made, final)
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    logger.warning("spillway.deepspeed: %s has no RENAME_EXCHANGE (%s): the new copy of %s goes in "
                                   "with two renames, the previous one aside as %s until it is removed", save_dir,
                                   e.strerror, tag, aside)
                    shutil.rmtree(aside, ignore_errors=True)
                    os.rename(final, aside)
                    state = "aside"
                    os.rename(made, final)
                    made = aside
            state = "swapped"
            _fsync_directory(save_dir)
            shutil.rmtree(made, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 (raised below, on every rank)
            failure = e
    said = {"staged": f"the new checkpoint is whole in {made} and {final} is the previous one, unchanged",
            "aside": f"the previous checkpoint is in {aside} and the new one whole in {made}",
            "swapped": f"the new checkpoint is in place in {final}; the previous one may remain in {made}"}[state]
    failed = [str(f) for f in _gather(None if failure is None else f"{type(failure).__name__}: {failure} ({said})")
              if f]
    if failed:
        raise _spillway.IoError(
            f"spillway.deepspeed: save_checkpoint({save_dir!r}, tag={tag!r}): putting the new copy of the tag in "
            f"place failed: {'; '.join(failed)}. Move the directories by hand, or save under another tag") \
            from failure


def _gather(item):
    """[item of rank 0, item of rank 1, ...]: every rank must call it."""
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [item]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, item)
    return everyone


def _owned(obj):
    """`obj` with each CPU tensor in it (through dicts, lists and tuples) cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.device.type == "cpu" else obj
    if isinstance(obj, dict):
        return type(obj)((k, _owned(v)) for k, v in obj.items()) if type(obj) is dict else obj
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_owned(v) for v in obj)
    return obj


def _ours(engine):
    return _ENGINE is not None and isinstance(getattr(engine, "checkpoint_engine", None), _ENGINE)


def install(patch):
    """Puts the checkpoint engine in place in each DeepSpeedEngine made from now on (where DeepSpeed
    chose its TorchCheckpointEngine; the others, Nebula, FastPersist, DataStates and the decoupled
    engine, are left as they are), and wraps save_checkpoint and load_checkpoint."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # noqa: PLC0415
    from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: PLC0415

    cls = engine_class()
    configure = _defined(DeepSpeedEngine, "_configure_checkpointing")
    save = _defined(DeepSpeedEngine, "save_checkpoint")
    load = _defined(DeepSpeedEngine, "load_checkpoint")

    def _configure_checkpointing(self, *args, **kwargs):
        result = configure(self, *args, **kwargs)
        if type(self.checkpoint_engine) is TorchCheckpointEngine:
            self.checkpoint_engine = cls(self._config)
        return result

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, *args, **kwargs):  # noqa: B006 (DeepSpeed's signature)
        if not _ours(self):
            return save(self, save_dir, tag, client_state, save_latest, *args, **kwargs)
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        ckpt = self.checkpoint_engine
        # One id per save, rank 0's, in every rank's manifest: the load refuses manifests of two saves.
        ckpt.save_id = _gather(secrets.token_hex(8) if _rank_and_world()[0] == 0 else None)[0]
        # A tag saved again is written beside the one on disk and swapped in once whole: a save
        # killed midway leaves the previous copy (Note [DeepSpeed checkpoints]).
        again = any(_gather(_holds_a_save(os.path.join(save_dir, tag))))
        into = f"{tag}{_STAGING}{ckpt.save_id}" if again else tag
        if again:
            _remove_staged(save_dir, tag, ckpt.node_local)
        try:
            result = save(self, save_dir, into, client_state, False, *args, **kwargs)
            failed = ckpt.failure
        finally:
            ckpt.save_id, ckpt.failure = None, None
        everyone = _gather(f"rank {self.global_rank}: {failed[0]}: {failed[1]}" if failed else None)
        if any(everyone):
            raise _spillway.IoError(
                f"spillway.deepspeed: save_checkpoint({save_dir!r}, tag={tag!r}) failed: "
                f"{'; '.join(m for m in everyone if m)}. The checkpoint {tag} is not whole (a load of it is "
                "refused) and `latest` was not changed. Fix the cause (space, permissions) and save again") \
                from (failed[1] if failed else None)
        if again:
            _swap_in(save_dir, into, tag, ckpt.node_local)
        if not save_latest:
            return result
        # DeepSpeed writes `latest` by truncating it in place; here it is written once every rank has
        # committed, to a temporary file renamed over it, after save_dir's entry for the tag's
        # directory is durable.
        failure = None
        if self.global_rank == 0:
            latest = os.path.join(save_dir, "latest")
            try:
                _fsync_directory(save_dir)
                _replace_durably(_temporary(latest), latest, lambda f: f.write(tag.encode()))
                _fsync_directory(save_dir)
            except Exception as e:  # noqa: BLE001 (raised below, on every rank)
                failure = e
        if not all(_gather(failure is None)):
            raise _spillway.IoError(
                f"spillway.deepspeed: save_checkpoint({save_dir!r}, tag={tag!r}): the checkpoint is whole on disk "
                f"but rank 0 could not make {os.path.join(save_dir, 'latest')} name it durably"
                f"{f' ({failure})' if failure else ' (rank 0 raised the cause)'}. Load it by its tag, or fix the "
                f"directory and save again") from failure
        return result

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        if not _ours(self):
            return load(self, load_dir, tag, *args, **kwargs)
        if tag is None:
            # Rank 0's `latest`, for every rank: the tag checked is the tag loaded, on all of them.
            named = None
            if _rank_and_world()[0] == 0:
                universal = getattr(self, "load_universal_checkpoint", lambda: False)()
                latest = os.path.join(load_dir, "latest_universal" if universal else "latest")
                if os.path.isfile(latest):
                    with open(latest) as f:
                        named = f.read().strip()
            tag = _gather(named)[0]
        if tag is not None:
            verify(load_dir, tag, getattr(self.checkpoint_engine, "node_local", False))
        with state_in_place(getattr(self.optimizer, "optimizer", None)):
            path, client_state = load(self, load_dir, tag, *args, **kwargs)
        # The caller's own state comes from the mapped file: copied, so nothing stays mapped.
        return path, _owned(client_state)

    patch(DeepSpeedEngine, "_configure_checkpointing", _configure_checkpointing)
    patch(DeepSpeedEngine, "save_checkpoint", save_checkpoint)
    patch(DeepSpeedEngine, "load_checkpoint", load_checkpoint)
