"""Spillway's C++ log lines in Python's `logging`, under the logger "spillway".

The C++ core emits a line when its level is enabled: SPILLWAY_LOG (error, warning, info or debug;
default warning), or spillway.set_log_level(). Its lines queue in C++ (python/src/log_bridge.cc:
the threads that log may hold Spillway's locks, so they never wait for the GIL) and a daemon thread
hands them to the logger. Where no handler is configured for it, a line at or above the logger's
level prints on stderr as "spillway <level>: <message>", as the C++ core prints without Python.
So warnings and errors print by default, informational lines only when asked for, and an
application that configures `logging` gets them as records of the "spillway" logger.
"""
import atexit
import logging
import os
import sys
import threading

from . import _spillway

logger = logging.getLogger("spillway")

_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
_lock = threading.Lock()
_thread = None


def _emit(level, message):
    """One line from C++. Never raises: it runs on the pump thread and at exit."""
    try:
        lvl = _LEVELS.get(level, logging.WARNING)
        if logger.hasHandlers():
            logger.log(lvl, message)
        elif logger.isEnabledFor(lvl) and sys.stderr is not None:
            sys.stderr.write(f"spillway {level}: {message}\n")
            sys.stderr.flush()
    except Exception:  # a broken handler or stream: the line has nowhere left to go
        pass


def _pump():
    _spillway._log_pump(_emit)


def _start():
    global _thread
    with _lock:
        _spillway._log_route(True)
        _thread = threading.Thread(target=_pump, name="spillway-log", daemon=True)
        _thread.start()


def _stop():
    """At exit: lines go to stderr again (C++ threads may still log), and the queue is emptied."""
    global _thread
    with _lock:
        _spillway._log_route(False)
        _spillway._log_stop()
        if _thread is not None:
            _thread.join(timeout=10)
            _thread = None
        _spillway._log_flush(_emit)


def flush():
    """Returns once every line the C++ core logged before the call has reached the logger."""
    _spillway._log_flush(_emit)


def set_level(level):
    """The C++ core's level (what it emits at all) and the "spillway" logger's."""
    _spillway.set_log_level(level)
    logger.setLevel(_LEVELS[level])


def _setup():
    env = os.environ.get("SPILLWAY_LOG", "")
    if env in _LEVELS:
        logger.setLevel(_LEVELS[env])
    _start()
    atexit.register(_stop)
    # The C++ side routes a forked child's lines to stderr (its queue had no reader there); the
    # child's own pump takes over again.
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _after_fork_in_child():
    global _lock
    _lock = threading.Lock()  # another parent thread may have held it across the fork
    _start()
