"""spillway.node: one host budget for every rank of every job under one memory limit (Note [Node
governor] in docs/allocator.md).

What the OOM killer enforces is a memory limit (the cgroup that holds the process, else the
machine), not a job: so the ledger belongs to the limit, and each job is a part of it.
spillway.install() joins it by itself: a process a launcher started as a local rank of its job
(torchrun, Accelerate and the deepspeed launcher set LOCAL_RANK, mpirun and srun their own
variables; torch.multiprocessing.spawn's ranks share the process that started them;
SPILLWAY_NODE_JOB names a job explicitly), any other process as a job of its own until it learns
its job from its process group (learn_job(), at init_process_group or deepspeed.initialize). So every
process's pinned and pageable arenas book their regions in one shared ledger: a rank may take what
the others leave free, two jobs under one limit share its budget, and the limit as a whole is never
passed. A process no ledger can take warns once (NodeWarning). This module reads and steers that ledger:

    spillway.node.stats()          # the ledger: budget, committed, each job, each rank by tier/kind
    spillway.node.memory()         # this process's resident memory, every byte by owner
    spillway.node.learn_job()      # after init_process_group: a process no launcher described
    python -m spillway.node        # the live ledgers of this user on the machine

Settings (environment, the same on every rank): SPILLWAY_NODE=0 turns the node budget off,
SPILLWAY_NODE_BUDGET_BYTES sets the budget, SPILLWAY_NODE_RESERVE_BYTES the reserve kept back from
the memory limit (default max(2 GiB, limit / 8)), SPILLWAY_NODE_NVME_BUDGET_BYTES caps NVMe,
SPILLWAY_NODE_LEDGER=<name> keeps the job in a ledger of that name instead of its memory limit's
(for limits the kernel does not know of, and tests).
"""
import argparse
import atexit
import ctypes
import functools
import json
import os
import re
import sys
import time
import warnings

from . import _spillway

_DIR = "/dev/shm"
_sampled = {"at": 0.0, "peak": 0, "workers": 0, "memory_at": 0.0, "memory_took": 0.0}
# Seconds between two reads of /proc/self/smaps at step boundaries: at least 10, and at least 100
# times what the last read took, so the reads cost the training thread at most 1% (the kernel walks
# the page tables: about 10 ms per resident GiB measured here).
_MEMORY_INTERVAL = 10.0
_MEMORY_SHARE = 100


def _env_bytes(name):
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        value = int(text, 0)
    except ValueError:
        value = -1
    if value <= 0:
        raise _spillway.InvalidArgument(f"{name}={text!r}: give a positive number of bytes, e.g. {64 << 30}")
    return value


SPAWNED = "multiprocessing"  # job()["source"] of a rank that torch.multiprocessing.spawn started


def _proc_start_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]  # field 22: the start time, in clock ticks


def _inherited(name, parent_pid):
    """The variable has the value it had when the parent process started (/proc/PID/environ)."""
    try:
        with open(f"/proc/{parent_pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return False
    want = f"{name}={os.environ.get(name, '')}".encode()
    return want in entries


def job():
    """The job this process is a local rank of: a dict with id (empty when no launcher started it),
    source, local_rank (-1: the first free slot) and local_world_size (0: not said).

    From the launcher's environment (torchrun, Accelerate, the deepspeed launcher, mpirun, Hydra,
    MVAPICH2, PALS, srun, or SPILLWAY_NODE_JOB); else, for a process that multiprocessing started
    (torch.multiprocessing.spawn, Lightning's ddp_spawn, a Pool), the process that started it: its
    ranks set no variable before the script's first line, and each would otherwise take a budget of
    its own from the same memory."""
    found = _spillway._node_job()
    import multiprocessing  # noqa: PLC0415 (only here: most processes never ask)

    parent = multiprocessing.parent_process()
    parent_pid = parent.pid if parent is not None else None
    if parent_pid is None and getattr(multiprocessing.current_process(), "_inheriting", False):
        # spawn and forkserver import the parent's main module (a module-level install()) before
        # parent_process() is set: the process that started this one is its parent still.
        parent_pid = os.getppid()
    if parent_pid is None:
        return found
    if found["id"] and not (found["rank_variable"] and _inherited(found["rank_variable"], parent_pid)):
        return found  # its launcher set the rank variable for this process
    # A launcher's variable this process only inherited (mp.spawn under srun or mpirun): every
    # spawned rank would claim the parent's local rank, and the count is the launcher's.
    if found["source"] == "SPILLWAY_NODE_JOB":
        return dict(found, local_rank=-1, local_world_size=0, rank_variable="")
    try:
        start = _proc_start_ticks(parent_pid)
    except OSError:
        return found  # the parent is gone: nothing left to share a budget with
    return {"id": f"spawn-{parent_pid}-{start}", "local_rank": -1, "rank_variable": "",
            "local_world_size": found["local_world_size"] if not found["id"] else 0,  # LOCAL_WORLD_SIZE
            "source": f"{SPAWNED}: the process that started every rank (pid {parent_pid})"}


class NodeWarning(UserWarning):
    """A process that joined no node ledger: its arenas keep budgets of their own."""


def _caller_level():
    """The warnings stacklevel of the first caller outside the spillway package, counted from the
    function that calls this one."""
    here, level, frame = os.path.dirname(os.path.abspath(__file__)), 1, sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(here + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def join_alone(warn=True):
    """Joins the ledger of this process's memory limit as a job of its own ("process-<pid>", one
    local rank): what spillway.install() does for a process no launcher describes. Where no ledger
    can take it (its jobs or slots all held by live ranks, /dev/shm missing or full, /proc
    unreadable, a ledger of another PID namespace), warns once, naming the process, the reason and
    what to set, and returns False; bad settings (SPILLWAY_NODE_*) raise as join() does, and so does
    every error when not `warn`."""
    try:
        # Its children inherit no launcher's variables: those that multiprocessing starts
        # (mp.spawn's ranks) join the job spawn-<pid>, the others a job of their own each.
        join(job_id=f"process-{os.getpid()}", local_rank=0, local_world_size=1, children_are_ranks=True)
        return True
    except _spillway.Error as e:
        if not warn or isinstance(e, _spillway.InvalidArgument):
            raise
        import warnings  # noqa: PLC0415 (only here: most processes never warn)

        warnings.warn(
            f"spillway: process {os.getpid()} ({' '.join(sys.argv)[:120]}) joined no node ledger, so its "
            f"arenas keep budgets of their own (by default 3/4 of the memory limit) beside whatever else "
            f"runs under that limit: {type(e).__name__}: {e}. Free room in the ledger (python -m "
            f"spillway.node lists its jobs), give this process a ledger of its own name "
            f"(SPILLWAY_NODE_LEDGER=<name>), or set SPILLWAY_NODE=0 to keep the budgets of its own without "
            f"this warning", NodeWarning, stacklevel=_caller_level())
        return False


def joined():
    return _spillway._node_joined()


def join(job_id=None, local_rank=None, local_world_size=None, budget_bytes=None, reserve_bytes=None,
         nvme_budget_bytes=None, directory=_DIR, ledger_name=None, children_are_ranks=False):
    """Joins (or creates) the ledger of this process's memory limit as a rank of the job, and makes
    it this process's: arenas made afterwards book their regions there. Arguments left None come
    from the launcher's environment and the SPILLWAY_NODE_* variables. Unless
    `children_are_ranks`, the processes this one starts afterwards (spawned DataLoader workers,
    subprocesses, which inherit its launcher's variables) join nothing: their pages are its
    workers'. Returns the segment's path."""
    env = job()
    job_id = job_id or env["id"]
    if not job_id:
        raise _spillway.FailedPrecondition(
            "spillway.node.join(): no job to join. Start the ranks with torchrun, accelerate launch or "
            "the deepspeed launcher (they set LOCAL_RANK), or name the job: SPILLWAY_NODE_JOB=<name>")
    if local_rank is None:
        local_rank = env["local_rank"]
    if local_world_size is None:
        local_world_size = env["local_world_size"]
    budget_bytes = budget_bytes if budget_bytes is not None else _env_bytes("SPILLWAY_NODE_BUDGET_BYTES")
    reserve_bytes = reserve_bytes if reserve_bytes is not None else _env_bytes("SPILLWAY_NODE_RESERVE_BYTES")
    nvme_budget_bytes = (nvme_budget_bytes if nvme_budget_bytes is not None
                         else _env_bytes("SPILLWAY_NODE_NVME_BUDGET_BYTES") or 0)
    limit = _spillway.memory_limit_bytes()
    if budget_bytes is None and reserve_bytes is not None:
        if reserve_bytes >= limit:
            raise _spillway.InvalidArgument(
                f"SPILLWAY_NODE_RESERVE_BYTES={reserve_bytes} is not below the memory limit of {limit} "
                f"bytes; keep back less")
        budget_bytes = limit - reserve_bytes
    if ledger_name is None:
        ledger_name = os.environ.get("SPILLWAY_NODE_LEDGER", "")
    path = _spillway._node_join(job_id, ledger_name, local_rank, local_world_size, budget_bytes or 0, limit,
                                nvme_budget_bytes, directory)
    atexit.register(_spillway._node_exit)  # the slot is freed at exit; the last rank removes the segment
    if not children_are_ranks:
        # Children (spawned DataLoader workers, subprocesses) inherit LOCAL_RANK and the job's name;
        # this tells their spillway.install() that they are not ranks.
        os.environ["SPILLWAY_NODE_MEMBER"] = str(os.getpid())
    return path


_learned = {"calls": 0, "declared": False}
LONE = "process-"  # the job of a process no launcher described (join_alone)


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _learn_at_init_process_group():
    """Makes torch.distributed.init_process_group call learn_job() once the group exists (what
    spillway.install() does): every rank of a group calls init_process_group, and every rank, joined
    or not, takes part in the exchange, so it is as collective as the call. A group made before
    install() is learned from at deepspeed.initialize (spillway.deepspeed.install()) or by calling
    learn_job()."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    original = dist.init_process_group
    if getattr(original, "__spillway_original__", None) is not None:
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        out = original(*args, **kwargs)
        learn_job()
        return out

    init_process_group.__spillway_original__ = original
    dist.init_process_group = init_process_group


def learn_job(timeout=None):
    """Where install() found no launcher to name this process's job (it joined as a job of its own,
    "process-<pid>") or its count of local ranks, learns both from torch.distributed's process group
    once it exists: the ranks tell each other through the group's store where they run (the host's
    boot and the ledger of their memory limit), and those under one limit become one job, local
    ranks in the order of their global ranks, with what each already booked; it returns when every
    rank has moved. Every rank of the group must call it, joined or not (collective: spillway.install()
    makes init_process_group call it, and spillway.deepspeed.install() calls it at each
    deepspeed.initialize, before admission). Returns the job's name when this rank moved or learned
    its count, else None. A rank that does not answer within `timeout` seconds (default
    SPILLWAY_NODE_ADMIT_TIMEOUT, else 300), or a move the ledger refuses, is named in a NodeWarning,
    and the rank that warns stays where it is (ranks that heard from everyone may have moved). No
    rank moves where one of its group under the limit already declared for admission."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if timeout is None:
        timeout = float(os.environ.get("SPILLWAY_NODE_ADMIT_TIMEOUT", "300"))
    rank, world = dist.get_rank(), dist.get_world_size()
    ledger = stats() if joined() else None
    import socket  # noqa: PLC0415

    me = {"where": f"{socket.gethostname()} {_boot_id()} {ledger['path'] if ledger else ''}", "pid": os.getpid(),
          "start": _proc_start_ticks(os.getpid()), "job": ledger["job"] if ledger else "",
          "lone": bool(ledger) and ledger["job"] == f"{LONE}{os.getpid()}", "declared": _learned["declared"],
          "local_rank": next((r["local_rank"] for r in ledger["ranks"] if r["pid"] == os.getpid()), -1)
          if ledger else -1, "local_world_size": ledger["local_world_size"] if ledger else 0}
    _learned["calls"] += 1  # every rank calls as often: the keys of one call are its own
    prefix = f"spillway-node-job/{_learned['calls']}/"
    store = dist.distributed_c10d._get_default_store()
    everyone = _store_round(store, prefix + "where/", rank, world, me, timeout, me["job"])
    if everyone is None:
        return None
    moved, error = None, None
    if ledger is not None:
        local = [r for r in range(world) if everyone[r]["where"] == me["where"]]
        lone = [everyone[r]["lone"] for r in local]
        try:
            if any(everyone[r]["declared"] for r in local):  # every rank sees it: none moves
                if me["lone"] or me["local_world_size"] == 0:
                    error = ("a rank of its process group under this memory limit already declared its need "
                             "for admission (spillway.install(declare_bytes=...)) in the job it joined; set "
                             "LOCAL_RANK and LOCAL_WORLD_SIZE (or SPILLWAY_NODE_JOB) before install() instead")
            elif me["lone"] and all(lone):
                first = everyone[local[0]]
                moved = f"dist-{first['pid']}-{first['start']}"
                _spillway._node_rekey(moved, local.index(rank), len(local))
            elif me["local_world_size"] == 0 and not any(lone) and len({everyone[r]["job"] for r in local}) == 1:
                moved = me["job"]  # its launcher gave no count
                _spillway._node_rekey(moved, me["local_rank"], len(local))
            elif any(lone) and not all(lone):
                error = (f"of the {len(local)} ranks of its process group under this memory limit, {sum(lone)} "
                         f"joined as jobs of their own and the others as a launcher's job; start them all the "
                         f"same way")
        except _spillway.Error as e:
            moved, error = None, f"{type(e).__name__}: {e}"
    if error is not None:
        warnings.warn(f"spillway.node: rank {rank} stays in job '{me['job']}': {error}", NodeWarning, stacklevel=2)
    # A second round: no rank reads the ledger, or declares for admission, before every rank moved.
    _store_round(store, prefix + "moved/", rank, world, moved or "", timeout, moved or me["job"])
    return moved


def _store_round(store, prefix, rank, world, value, timeout, job_name):
    """Every rank of the group writes `value` under `prefix` and reads everyone's (a list by rank);
    None, after a NodeWarning naming the ranks that did not write within `timeout` seconds."""
    import datetime  # noqa: PLC0415

    store.set(prefix + str(rank), json.dumps(value))
    keys = [prefix + str(r) for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 (the store's timeout error differs between releases)
        missing = [r for r in range(world) if not store.check([keys[r]])]
        warnings.warn(f"spillway.node: rank {rank} could not learn its job: rank(s) {missing} of the process group "
                      f"did not answer within {timeout:g} s ({type(e).__name__}: {e}); it stays in job "
                      f"'{job_name}'", NodeWarning, stacklevel=3)
        return None
    return [json.loads(store.get(k)) for k in keys]


def leave():
    """Leaves the node now: this rank's slot and every byte it booked are given back, and regions
    its arenas map afterwards are refused (spillway.FailedPrecondition). Done at exit by itself."""
    _spillway._node_leave()


def stats():
    """The ledger this rank joined (reaping dead ranks first): budget, committed, headroom, its jobs
    (each with its ranks' bytes), and per rank its job, bytes by tier (pinned, pageable, nvme), live
    bytes by kind, declared need and workers. "job" and "local_world_size" are this rank's job's."""
    return _spillway._node_stats()


def inspect(path):
    """The ledger of any of this user's node segments, read from outside without joining ("job" is
    empty: the view is no rank's)."""
    return _spillway._node_inspect(path)


def segments(directory=_DIR):
    """This user's node segments on the machine (paths)."""
    return _spillway._node_segments(directory)


def admit(need_bytes, workers_fork_bytes=0, timeout=None, detail=""):
    """Declares this rank's host need and waits until every local rank has declared; raises
    spillway.OverBudget on every rank, with one message, when their sum passes the node budget, and
    spillway.Unavailable naming the ranks that never declared within `timeout` seconds (default
    SPILLWAY_NODE_ADMIT_TIMEOUT, else 300). Before declaring, publishes this rank's memory by owner:
    the verdict also checks the needs against the memory limit beside what the ranks under it hold
    outside the arenas, measured (a model loaded on every rank, torch's other tensors, the
    interpreter), not only against the budget's fixed reserve."""
    if timeout is None:
        timeout = float(os.environ.get("SPILLWAY_NODE_ADMIT_TIMEOUT", "300"))
    try:
        memory()
    except Exception as e:  # noqa: BLE001 (admission goes on with what the ledger has)
        warnings.warn(f"spillway.node: admission could not measure this rank's memory outside the arenas "
                      f"({type(e).__name__}: {e}); what it holds there is not counted", NodeWarning,
                      stacklevel=2)
    _learned["declared"] = True  # learn_job() moves no rank of a group where one declared
    _spillway._node_admit(int(need_bytes), int(workers_fork_bytes), float(timeout), detail)


def children(pid):
    """The pids of the processes `pid` started (its threads' /proc children lists); [] when it is
    gone."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _rollup_bytes(pid, keys):
    """The sum of `keys` ("Pss_Anon:", ...) of /proc/<pid>/smaps_rollup, in bytes; 0 for a process
    gone."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(keys):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def _private_bytes(pid):
    return _rollup_bytes(pid, ("Private_Clean:", "Private_Dirty:"))


_planned = {"phases": None}  # set by admission at deepspeed.initialize (spillway.deepspeed)


def planned_phases():
    """The node's peaks ahead that admission planned at the last deepspeed.initialize (Note [Phase
    peaks] in docs/offload.md), from this rank's level then: a list of {"name" ("load": the level
    then; "initialize", "epoch boundary", "checkpoint", "final save"), "rank0", "other_rank", "node",
    "naive_node" (the same run with DeepSpeed's defaults)} in bytes, planned with no DataLoader
    workers (admission cannot know them) and checked on DeepSpeed's CPU accelerator only; None
    before any admission (no node budget joined, SPILLWAY_NODE_ADMIT=0, nothing to plan from) and
    for a stage other than ZeRO-3."""
    return _planned["phases"]


def anon_shared_bytes():
    """This process's anonymous and shared memory (Pss_Anon + Pss_Shmem): the level the planner's
    phases start from at deepspeed.initialize (Note [Phase peaks] in docs/offload.md)."""
    return _rollup_bytes(os.getpid(), ("Pss_Anon:", "Pss_Shmem:"))


def workers_private_bytes(pid=None):
    """(count, bytes): the processes below `pid` (default: this one), such as DataLoader workers,
    and their private pages (Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup): what each
    copied or made for itself since it forked."""
    pid = os.getpid() if pid is None else pid
    todo, count, total = children(pid), 0, 0
    while todo:
        child = todo.pop()
        count += 1
        total += _private_bytes(child)
        todo += children(child)
    return count, total


def _sample_workers(min_interval=1.0):
    """At a step boundary, at most once per `min_interval` seconds: reads the workers' private bytes
    from /proc and publishes them to the node ledger, keeping the epoch's peak."""
    now = time.monotonic()
    if not joined() or now - _sampled["at"] < min_interval:
        return
    _sampled["at"] = now
    count, total = workers_private_bytes()
    if total >= _sampled["peak"]:
        _sampled["peak"], _sampled["workers"] = total, count
    _spillway._node_publish_workers(total, count)


def _python_arena_bytes():
    """The bytes of CPython's object arenas (obmalloc), from its own malloc statistics
    (sys._debugmallocstats' text, written into memory); 0 where obmalloc is off (PYTHONMALLOC=malloc:
    the objects are then malloc's) or the interpreter does not export the call."""
    stats = getattr(ctypes.pythonapi, "_PyObject_DebugMallocStats", None)
    if stats is None:
        return 0
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    stats.argtypes = [ctypes.c_void_p]
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    out = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not out:
        return 0
    try:
        stats(out)
    finally:
        libc.fclose(out)  # sets buf and size
    try:
        text = ctypes.string_at(buf.value, size.value).decode(errors="replace") if buf.value else ""
    finally:
        libc.free(buf)
    m = re.search(r"^\d+ arenas \* \d+ bytes/arena\s*=\s*([\d,]+)", text, re.M)
    return int(m.group(1).replace(",", "")) if m else 0


def _torch_pinned_bytes():
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def memory(publish=True):
    """This process's resident memory (Rss), every byte by owner (Note [Every byte named] in
    docs/allocator.md): "owners" maps arenas, torch_cpu, torch_pinned, cuda_driver, python, malloc,
    malloc_free, mapped_files, shared, libraries and unowned to bytes; "named_fraction" is the
    share some owner other than "unowned" holds; "counted_beyond_resident_bytes" what the counters
    claimed past the anonymous bytes (scaled down); "text" says it in a line. With `publish` (and a
    joined node budget) the owners go to this rank's row of the ledger, where `spillway node`,
    Prometheus and the epoch report read them. One read of /proc/self/smaps: a few ms, more where
    much is resident (the kernel walks the page tables to count it)."""
    router = _spillway._router_stats()
    return _spillway._process_memory(max(0, router.get("forwarded_live_bytes", 0)), _torch_pinned_bytes(),
                                     _python_arena_bytes(), publish)


def _sample_memory(min_interval=_MEMORY_INTERVAL):
    """At a step boundary, at most once per `min_interval` seconds and per 100 times the last read's
    duration: publishes memory(). A failure warns once and ends the sampling: it must not stop
    training."""
    now = time.monotonic()
    if not joined() or _sampled["memory_at"] is None or \
            now - _sampled["memory_at"] < max(min_interval, _MEMORY_SHARE * _sampled["memory_took"]):
        return None
    _sampled["memory_at"] = now
    try:
        out = memory()
        _sampled["memory_took"] = time.monotonic() - now
        return out
    except Exception as e:  # noqa: BLE001 (a boundary of the user's training loop)
        _sampled["memory_at"] = None
        warnings.warn(f"spillway.node: this rank's memory by owner is no longer published: {type(e).__name__}: "
                      f"{e}", NodeWarning, stacklevel=3)
        return None


def _epoch_boundary():
    """At an epoch boundary: publishes the ended epoch's peak of the workers' private bytes (they
    have usually exited by now) and returns the node ledger for the epoch's report."""
    if not joined():
        return None
    _sampled["at"] = 0.0
    _sample_workers()
    _sample_memory(0.0)
    _spillway._node_publish_workers(_sampled["peak"], _sampled["workers"])
    _sampled["peak"] = _sampled["workers"] = 0
    return stats()


def _format(ledger):
    lines = [ledger["text"].rstrip()]
    for r in ledger["ranks"]:
        count, total = workers_private_bytes(r["pid"])
        if count:
            lines.append(f"  job {r['job']} local rank {r['local_rank']}: {count} child process(es) now, "
                         f"{total / (1 << 20):.1f} MiB private")
    return "\n".join(lines)


def main(argv=None):
    """`python -m spillway.node [SEGMENT | --job NAME] [--watch SECONDS] [--json]`: prints the live
    ledger of each of this user's memory limits (or one segment's, or the one holding a job), as
    nvidia-smi does for device memory."""
    p = argparse.ArgumentParser(prog="python -m spillway.node", description=main.__doc__)
    p.add_argument("segment", nargs="?", help="a segment path (default: every one of this user's)")
    p.add_argument("--job", help="only the ledger holding this job (SPILLWAY_NODE_JOB, or the id its launcher gave)")
    p.add_argument("--dir", default=_DIR, help="where the segments are (default /dev/shm)")
    p.add_argument("--watch", type=float, default=0, help="print again every SECONDS")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    while True:
        paths = [args.segment] if args.segment else segments(args.dir)
        ledgers, bad = [], 0
        for path in paths:
            try:
                led = inspect(path)
            except _spillway.Error as e:
                if not args.segment and not os.path.exists(path):
                    continue  # its last rank removed it meanwhile
                print(f"spillway node: {path}: {e}", file=sys.stderr)
                bad += 1
                continue
            if not args.job or any(j["name"] == args.job for j in led["jobs"]):
                ledgers.append(led)
        if not ledgers and (not bad or args.job):
            print(f"spillway node: no node segment of uid {os.geteuid()} in {args.dir}"
                  f"{' with job ' + args.job if args.job else ''}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps([{k: v for k, v in led.items() if k != "text"} for led in ledgers]))
        else:
            print("\n\n".join(_format(led) for led in ledgers))
        sys.stdout.flush()
        if not args.watch:  # with --job, an unreadable other ledger does not fail the look at its own
            return 0 if (ledgers if args.job else not bad) else 1
        time.sleep(args.watch)


if __name__ == "__main__":
    sys.exit(main())
