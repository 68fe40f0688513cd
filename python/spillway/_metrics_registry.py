"""The live Prometheus exporters of this process, and the NVMe swap stores that join them: shared by
spillway.metrics, whose serve() adds each exporter it starts (watching the swap stores made before
it), and spillway.deepspeed._swap, whose stores made later join every live exporter. Both import it; neither
imports the other for it. Private.
"""
import os
import threading
import weakref

_lock = threading.Lock()
_exporters = {}  # pid -> WeakSet of its live exporters (a forked child never touches its parent's)


def _after_fork_in_child():
    global _lock
    _lock = threading.Lock()  # a fork while another thread held it would leave it held forever


os.register_at_fork(after_in_child=_after_fork_in_child)


def add_exporter(exporter, stores):
    """`exporter` watches each swap store `stores()` returns and, from now on, each one made later
    (watch_swap_store). `stores()` is called under the lock, so that a store made meanwhile is
    watched by one path or the other (or both: watching twice renders once)."""
    with _lock:
        for store in stores():
            store._watched_by(exporter)
        _exporters.setdefault(os.getpid(), weakref.WeakSet()).add(exporter)


def watch_swap_store(store):
    """A swap store made now joins every live exporter (spillway.deepspeed's swap calls it)."""
    with _lock:
        for exporter in list(_exporters.get(os.getpid(), ())):
            store._watched_by(exporter)  # watching twice (made while serve() ran) renders once
