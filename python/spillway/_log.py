"""Spillway's C++ log lines in Python's `logging`, under the logger "spillway".

The C++ core emits a line when its level is enabled: SPILLWAY_LOG (error, warning, info or debug;
default warning), or spillway.set_log_level(). Its lines queue in C++ (python/src/bind_base.cc:
the threads that log may hold Spillway's locks, so they never wait for the GIL), and the interpreter
hands them to `_emit` on the main thread between two bytecodes (Py_AddPendingCall). No thread is
started: a process that imports spillway stays single-threaded for fork(). Where no handler is
configured for the logger, a line at or above its level prints on stderr as
"spillway <level>: <message>", as the C++ core prints without Python. So warnings and errors print by
default, informational lines only when asked for, and an application that configures `logging`
gets them as records of the "spillway" logger.
"""
import atexit
import logging
import os
import sys

from . import _spillway

logger = logging.getLogger("spillway")

_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}


def _emit(level, message, on_stderr=False):
    """One line from C++; `on_stderr`: the C++ side already wrote it there (error lines, at once,
    in case the process dies before Python runs again). Raises only what is not an Exception
    (KeyboardInterrupt reaches the main thread)."""
    try:
        lvl = _LEVELS.get(level, logging.WARNING)
        if logger.hasHandlers():
            logger.log(lvl, message)
        elif not on_stderr and logger.isEnabledFor(lvl) and sys.stderr is not None:
            sys.stderr.write(f"spillway {level}: {message}\n")
            sys.stderr.flush()
    except Exception:  # a broken handler or stream: the line has nowhere left to go
        pass


def _stop():
    """At exit: what is queued goes to the logger, later lines (C++ threads may still log) to stderr."""
    _spillway._log_route(None)


def flush():
    """Hands every line the C++ core has queued to the logger now, on this thread (lines are
    otherwise delivered on the main thread when it next runs Python code)."""
    _spillway._log_flush()


def set_level(level):
    """The C++ core's level (what it emits at all) and the "spillway" logger's."""
    _spillway.set_log_level(level)
    logger.setLevel(_LEVELS[level])


def _setup():
    env = os.environ.get("SPILLWAY_LOG", "")
    if env in _LEVELS:
        logger.setLevel(_LEVELS[env])
    _spillway._log_route(_emit)
    atexit.register(_stop)
    # The C++ side routes a forked child's lines to stderr (its queue was reset); route them again.
    os.register_at_fork(after_in_child=lambda: _spillway._log_route(_emit))
