# The spillway package is built into <build>/python; ctest puts it on PYTHONPATH.
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: no GPU here


# ctest reports a file with any skipped test as skipped, never as passed (SKIP_RETURN_CODE in
# tests/CMakeLists.txt): a session that would exit 0 but skipped something exits with this code
# instead. Failures keep their own exit status, so a failure next to a skip still fails.
SKIPPED_EXIT = 77


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", ())) if reporter is not None else 0
    if exitstatus == 0 and skipped:
        session.exitstatus = SKIPPED_EXIT
