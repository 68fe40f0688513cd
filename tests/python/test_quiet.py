"""Quiet by default: a healthy import and use of spillway prints nothing on stderr. Informational
lines (which pinning an arena uses, where an NVMe budget came from) print with SPILLWAY_LOG=info or
spillway.set_log_level("info")."""
import os
import subprocess
import sys

import pytest

USE = """
import spillway, torch, sys
if len(sys.argv) > 1:
    spillway.set_log_level(sys.argv[1])
a = spillway.HostArena(budget_bytes=1 << 22)
t = a.empty((16,), torch.float32, kind="param", lifetime="persistent")
rt = spillway.install()
with spillway.tag("param"):
    x = torch.zeros(1 << 20)
h = spillway.aio_handle()
"""


def run(*args, env=None):
    e = {k: v for k, v in os.environ.items() if k != "SPILLWAY_LOG"}
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", USE, *args], capture_output=True, text=True, env=e, timeout=300)


def test_import_and_use_print_nothing_on_stderr():
    p = run()
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""


def test_info_lines_print_when_asked_for():
    for p in (run(env={"SPILLWAY_LOG": "info"}), run("info")):
        assert p.returncode == 0, p.stderr
        assert "spillway info: host arena" in p.stderr


def test_bad_input_an_unknown_level_is_refused_by_name():
    import spillway
    with pytest.raises(spillway.InvalidArgument, match="use error, warning, info or debug"):
        spillway.set_log_level("loud")


LOGGING = """
import logging, os, sys, spillway
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="REC %(name)s %(levelname)s %(message)s")
    spillway.set_log_level("info")
spillway._spillway._log_test_line("warning", "from a C++ thread", True)
spillway._spillway._log_test_line("info", "informational", False)
if sys.argv[2] == "fork":
    pid = os.fork()
    if pid == 0:
        spillway._spillway._log_test_line("warning", f"in the child {os.getpid()}", True)
        spillway._log.flush()
        os._exit(0)
    os.waitpid(pid, 0)
"""


def run_logging(*args):
    e = {k: v for k, v in os.environ.items() if k != "SPILLWAY_LOG"}
    return subprocess.run([sys.executable, "-c", LOGGING, *args], capture_output=True, text=True, env=e, timeout=300)


def test_without_logging_configured_warnings_print_on_stderr_and_info_lines_do_not():
    p = run_logging("plain", "no-fork")
    assert p.returncode == 0, p.stderr
    assert p.stderr == "spillway warning: from a C++ thread\n"


def test_lines_from_any_thread_reach_pythons_logging_as_records_of_the_spillway_logger():
    p = run_logging("configured", "no-fork")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    assert "REC spillway WARNING from a C++ thread\n" in p.stdout
    assert "REC spillway INFO informational\n" in p.stdout


def test_a_forked_child_logs_through_logging_too():
    p = run_logging("configured", "fork")
    assert p.returncode == 0, p.stderr
    assert "REC spillway WARNING in the child" in p.stdout, p.stdout + p.stderr
    assert p.stdout.count("from a C++ thread") == 1  # the parent's line, not repeated by the child


def test_import_starts_no_thread_so_fork_stays_single_threaded():
    code = "import os, threading, spillway; print(threading.active_count(), len(os.listdir('/proc/self/task')))"
    base = subprocess.run([sys.executable, "-c", code.replace(", spillway", ", torch")], capture_output=True,
                          text=True, timeout=300)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and base.returncode == 0, p.stderr + base.stderr
    assert p.stdout.split() == base.stdout.split(), f"threads with spillway {p.stdout}, with torch alone {base.stdout}"


def test_bad_input_an_unknown_SPILLWAY_LOG_is_said_at_import():
    e = {**os.environ, "SPILLWAY_LOG": "loud"}
    p = subprocess.run([sys.executable, "-c", "import spillway"], capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "SPILLWAY_LOG='loud' names no level; use error, warning, info or debug" in p.stderr


def test_an_error_line_reaches_stderr_at_once_even_if_the_process_aborts_and_prints_once():
    code = ("import os, sys, spillway; spillway._spillway._log_test_line('error', 'before the abort', True); "
            "sys.stderr.flush(); os.abort() if sys.argv[1] == 'abort' else None")
    e = {k: v for k, v in os.environ.items() if k != "SPILLWAY_LOG"}
    died = subprocess.run([sys.executable, "-c", code, "abort"], capture_output=True, text=True, env=e, timeout=300)
    assert died.returncode != 0
    assert "spillway error: before the abort\n" in died.stderr
    lived = subprocess.run([sys.executable, "-c", code, "live"], capture_output=True, text=True, env=e, timeout=300)
    assert lived.returncode == 0, lived.stderr
    assert lived.stderr == "spillway error: before the abort\n"


def test_a_keyboard_interrupt_in_a_log_handler_reaches_the_caller_and_loses_no_line():
    code = """
import logging, spillway
class Interrupting(logging.Handler):
    armed = True
    def emit(self, record):
        if Interrupting.armed:
            Interrupting.armed = False
            raise KeyboardInterrupt
        print("REC", record.getMessage())
logging.getLogger("spillway").addHandler(Interrupting())
try:  # the interrupt comes from the delivery: between two bytecodes, or in flush()
    spillway._spillway._log_test_line("warning", "line", True, 3)  # "line 0", "line 1", "line 2"
    spillway._log.flush()
except KeyboardInterrupt:
    print("interrupted")
for _ in range(1000):  # the rest arrives without a new line or a flush: a delivery was asked again
    pass
print("done")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "interrupted\nREC line 1\nREC line 2\ndone\n", p.stdout + p.stderr
