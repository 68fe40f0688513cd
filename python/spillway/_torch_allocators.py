"""torch's CPU and pinned allocators on Spillway (Note [Torch allocators] in docs/deepspeed.md):
spillway.install(), spillway.tag(), spillway.next_epoch() and the Runtime they act on. Public
through the spillway package; this module is private.
"""
import functools
import os
import threading

import torch

from . import _spillway, _torch_abi
from . import node as _node
from ._arena import HostArena
from ._spillway import FailedPrecondition, InvalidArgument, OverBudget, default_host_budget

_runtime = None
_install_lock = threading.Lock()


def check_torch_version():
    """Raises FailedPrecondition when the running torch is another minor release than the one the
    extension was built against: the allocator interfaces are C++ vtables that change between minor
    releases (torch keeps its C++ ABI within one, so 2.13.1 runs a 2.13.0 build)."""
    built = _spillway._torch_version_built
    if _torch_abi.series(built) != _torch_abi.series(torch.__version__):
        raise FailedPrecondition(
            f"spillway was built against torch {built} but torch {torch.__version__} is running; torch's "
            f"allocator interfaces differ between minor releases, so spillway.install() refuses to replace "
            f"them. Rebuild Spillway against this torch: pip install --no-build-isolation <spillway checkout> "
            f"(or scripts/install-deps, then cmake --build, in a CMake tree). Still usable without install(): "
            f"spillway.HostArena, aio_handle on a matching build")


class Runtime:
    """What spillway.install() made: `host`, the pageable arena that serves allocations inside
    spillway.tag() scopes, and `pinned`, the arena behind torch's pinned host allocator. Both report
    to one ledger, so `next_epoch()` / `mark_step()` cover both."""

    def __init__(self, host, pinned):
        self.host, self.pinned = host, pinned
        self._epoch, self._step = -1, -1
        self._epoch_open = self._step_open = False
        self._lock = threading.Lock()
        self.reports = []  # the boundary reports, newest last (bounded)

    @property
    def arenas(self):
        return (self.host, self.pinned)

    def _keep(self, report):
        self.reports.append(report)
        del self.reports[:-64]
        return report

    def _end_open_step(self):  # assumes self._lock
        if not self._step_open:
            return None
        report = self._keep(self.host._end_step())
        self._step_open = False
        return report

    def mark_step(self):
        """Ends the open step (returns its boundary report, or None) and opens the next."""
        _node._sample_workers()  # at most once a second: the workers' private bytes, from /proc
        _node._sample_memory()  # at most every 10 s: this rank's memory by owner, from /proc
        with self._lock:
            report = self._end_open_step()
            self._step += 1
            self.host._begin_step(self._step)
            self._step_open = True
            return report

    def next_epoch(self):
        """Ends the open step and epoch (returns the epoch's boundary report, or None before the
        first epoch) and opens the next epoch."""
        ledger = _node._epoch_boundary()  # the node's ledger with the ended epoch's workers
        with self._lock:
            self._end_open_step()
            report = None
            if self._epoch_open:
                report = self._keep(self.host._end_epoch())
                if ledger is not None:
                    report["node"] = ledger
            self._epoch += 1
            self.host._begin_epoch(self._epoch)
            self._epoch_open = True
            return report

    def stats(self):
        """The two arenas' stats (live bytes by kind, budget, pin mode), the router's counters and
        the pinned blocks' (deferred frees, recorded events)."""
        return {"host": self.host.stats(), "pinned": self.pinned.stats(), "router": _spillway._router_stats(),
                "pinned_blocks": _spillway._pinned_stats()}


def _name_worker_faults():
    """A DataLoader worker sets its own SIGSEGV handler when it starts, in front of the one its fork
    put there to name a fault on a page Spillway keeps out of forked children (Note [Fork fault] in
    docs/allocator.md): puts that one back in front, torch's behind it."""
    from torch.utils.data._utils import signal_handling  # noqa: PLC0415

    original = signal_handling._set_worker_signal_handlers
    if getattr(original, "_spillway", False):
        return

    @functools.wraps(original)
    def set_worker_signal_handlers(*args, **kwargs):
        result = original(*args, **kwargs)
        _spillway._fork_fault_rearm()
        return result

    set_worker_signal_handlers._spillway = True
    signal_handling._set_worker_signal_handlers = set_worker_signal_handlers


def _join_node(node):
    """Joins the node ledger of this process's memory limit (spillway.node) unless `node` is False,
    or None with SPILLWAY_NODE=0. A process a launcher started (or one SPILLWAY_NODE_JOB names)
    joins as a local rank of its job; any other process joins as a job of its own, and warns once
    when no ledger can take it (spillway.node.NodeWarning). A child of a rank that inherited its
    variables joins nothing: its pages are that rank's workers'. Returns the node's host budget,
    or None without one."""
    if (node is not None and not node) or (node is None and os.environ.get("SPILLWAY_NODE", "1") == "0"):
        return None
    if not _node.joined():
        member = os.environ.get("SPILLWAY_NODE_MEMBER")
        if node is None and member and member != str(os.getpid()):
            return None  # a child of a rank (it inherited the launcher's variables): not a rank
        env = _node.job()
        # A launcher that says how many local ranks it started (torchrun, accelerate, deepspeed,
        # mpirun, Slurm), a job named explicitly, or ranks that multiprocessing started (their
        # count is not known, so no admission: node.admit says so) join their job; a process
        # nothing describes (a plain `python`, a launcher of its own, LOCAL_RANK alone) is a job
        # of its own under the same limit.
        if bool(env["id"]) and (env["source"] == "SPILLWAY_NODE_JOB" or env["local_world_size"] > 0
                                or env["source"].startswith(_node.SPAWNED)):
            _node.join()
        elif not _node.join_alone(warn=node is None):  # node=True: raise where it cannot join
            return None
    return _node.stats()["host_budget_bytes"]


HOST_PEAK_SLACK = _spillway._ONE_LINE_HOST_PEAK_SLACK  # 0.05, offload/planner.h's, which the phase plan counts


def install(budget_bytes=None, pinned_budget_bytes=None, small_bytes=4096, policy="report", priority=1,
            node=None, declare_bytes=None):
    """Makes torch's CPU allocator and its pinned (CUDA host) allocator Spillway's, once per process.

    - Inside `with spillway.tag(kind):`, every CPU tensor of at least `small_bytes` comes from a
      pageable, MADV_DONTFORK arena with a hard budget (`budget_bytes`). Outside a scope, torch's own
      allocator serves it.
    - Every pinned allocation (pin_memory(), empty(pin_memory=True), non_blocking D2H outputs) comes
      from a pinned arena, exact size, whose blocks are reused only after the copies recorded on them
      completed, under its own budget (`pinned_budget_bytes`).
    The two budgets left unset share default_host_budget() (3/4 of the memory limit, which honours
    the cgroup's memory.max): the pageable arena 2/3 of it, the pinned one 1/3, so the two together
    never exceed it.

    Node budget (spillway.node): unless `node` is False (or None with SPILLWAY_NODE=0), both arenas book
    their regions in the ledger of the process's memory limit, whose budget every Spillway process
    under that limit shares: as a local rank of its job when a launcher started it (torchrun,
    accelerate launch, the deepspeed launcher, mpirun, srun: spillway.node.job() lists the
    variables read), torch.multiprocessing.spawn did (the job of the process that spawned it), or
    SPILLWAY_NODE_JOB names the job; else as a job of its own ("process-<pid>"). A process no
    ledger can take warns once (spillway.node.NodeWarning) and keeps budgets of its own (with
    `node=True` it raises instead). The two
    budgets left unset are the node's budget each (the node caps their sum and every other
    rank's). `declare_bytes`
    declares this rank's host need for admission (spillway.node.admit): every rank fails at once,
    with one message, when the ranks' needs together pass the node budget. Returns the Runtime.
    Raises FailedPrecondition when called twice, in a forked child, or under a torch other than the
    one Spillway was built against."""
    global _runtime
    with _install_lock:
        if _runtime is not None:
            raise FailedPrecondition(
                "spillway.install() was already called in this process; torch's allocators cannot be "
                "replaced twice. Use spillway.installed() to reach the Runtime it returned")
        check_torch_version()
        node_budget = _join_node(node)
        _node._learn_at_init_process_group()  # a rank no launcher described learns its job there
        if declare_bytes is not None:
            if node_budget is None:
                raise FailedPrecondition(
                    "spillway.install(declare_bytes=...) needs a node budget, and this process joined "
                    "none (node=False, SPILLWAY_NODE=0, a child of a rank, or no ledger could take it: "
                    "see the spillway.node.NodeWarning). Leave node=None or True and SPILLWAY_NODE unset")
            _node.admit(declare_bytes)
        total = default_host_budget()
        if node_budget is not None:
            budget_bytes = node_budget if budget_bytes is None else budget_bytes
            pinned_budget_bytes = node_budget if pinned_budget_bytes is None else pinned_budget_bytes
        if budget_bytes is None:
            budget_bytes = total - (pinned_budget_bytes if pinned_budget_bytes is not None else total // 3)
        if pinned_budget_bytes is None:
            pinned_budget_bytes = max(total - budget_bytes, 1 << 20)
        for name, value in (("budget_bytes", budget_bytes), ("pinned_budget_bytes", pinned_budget_bytes)):
            if value <= 0:
                raise InvalidArgument(f"spillway.install({name}={value}): must be positive; the default "
                                      f"budget is {total} bytes (3/4 of the memory limit)")
        # The host arena's retained cache may lift its high-water mark by 5% (of what is needed at
        # the peak; retained regions are still at most a quarter of the live bytes, and are given
        # back to ranks short of node budget): a training step's transients (DeepSpeed's float32
        # copies of the bf16 gradients, 1.2 GiB per ZeRO-2 backward at 16.8M parameters) are then
        # mapped once and reused each iteration, where at 0 their regions were unmapped at each
        # free and faulted in again (docs/benchmarks.md, "Whole iterations"). 5% removed those
        # faults as 25% did. The phase plan counts it (Note [Phase peaks] in docs/offload.md).
        host = HostArena(budget_bytes=budget_bytes, pinned=False, policy=policy, name="host",
                         peak_slack=HOST_PEAK_SLACK)
        pinned = HostArena(budget_bytes=pinned_budget_bytes, pinned=True, policy=policy, name="pinned",
                           share_ledger_with=host)
        _spillway._install(host, pinned, small_bytes, priority)
        _name_worker_faults()
        _runtime = Runtime(host, pinned)
        return _runtime


def installed():
    """The Runtime of spillway.install(), or None before it."""
    return _runtime


def next_epoch():
    """The one-line epoch boundary: closes the open epoch (returning its report) and opens the next.
    Call it at the top of each epoch, before the DataLoader forks its workers."""
    if _runtime is None:
        raise FailedPrecondition("spillway.next_epoch() before spillway.install(): nothing to bound")
    return _runtime.next_epoch()


_OVER_BUDGET = "spillway.OverBudget: "


def _as_over_budget(exc, hint=""):
    """torch.OutOfMemoryError raised by Spillway's allocators -> spillway.OverBudget, else None."""
    if isinstance(exc, torch.OutOfMemoryError) and str(exc).startswith(_OVER_BUDGET):
        message = str(exc)[len(_OVER_BUDGET):].split("\nException raised from")[0]
        return OverBudget(message + hint)
    return None


class tag:  # noqa: N801  (used like a function: `with spillway.tag("grad"):`)
    """`with spillway.tag(kind, lifetime="persistent"):` serves the CPU tensors made inside from
    Spillway's host arena, owned by `kind` (param, grad, master_weight, optimizer_state, swap_buffer,
    checkpoint, transient). Scopes nest (the innermost wins), follow autograd into its worker
    threads, and must be exited in the reverse order of entering. An allocation over the budget
    raises spillway.OverBudget."""

    def __init__(self, kind, lifetime="persistent", owner=0):
        self.kind, self.lifetime, self.owner = kind, lifetime, owner
        self._scope = None

    def __enter__(self):
        if _runtime is None:
            raise FailedPrecondition(
                f"spillway.tag({self.kind!r}) before spillway.install(): nothing would be served from "
                f"Spillway's arena. Call spillway.install() (or spillway.deepspeed.install()) first")
        if self._scope is not None:
            raise FailedPrecondition(f"spillway.tag({self.kind!r}) entered twice; make one per `with`")
        self._scope = _spillway._enter_tag(self.kind, self.lifetime, self.owner)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            _spillway._exit_tag(self._scope)
        except FailedPrecondition as e:
            if exc is None:
                raise
            # An exception is already on its way out: it is the one to see. The scope stays open on
            # this thread, and allocations on it keep its tag until the scope opened later exits.
            import warnings  # noqa: PLC0415

            warnings.warn(f"{e} (while {type(exc).__name__} propagates)", RuntimeWarning, stacklevel=2)
            return False
        self._scope = None
        translated = _as_over_budget(exc)
        if translated is not None:
            raise translated from exc
        return False

    def __call__(self, fn):
        """As a decorator: runs `fn` inside the scope."""
        import functools

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with tag(self.kind, self.lifetime, self.owner):
                return fn(*args, **kwargs)
        return wrapped

