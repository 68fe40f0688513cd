# The spillway package is built into <build>/python, and ctest puts it on PYTHONPATH; or, under
# scripts/test, it is pip-installed into build/venv, whose interpreter ctest runs
# (SPILLWAY_TESTS_INSTALLED=1): then the tests must import that installed package.
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: no GPU here
# The node ledger belongs to the memory limit, which every test process on this machine shares: each
# test process's ranks keep a ledger of their own (its children inherit the name), so the files that
# ctest runs side by side (one pytest process each) never see each other's bytes. The tests of the
# limit's own ledger unset it.
os.environ["SPILLWAY_NODE_LEDGER"] = f"pytest-{os.getpid()}"  # not inherited from outside


def pytest_sessionstart(session):
    if os.environ.get("SPILLWAY_TESTS_INSTALLED") == "1":
        import spillway

        build = os.path.realpath(os.environ["SPILLWAY_BUILD_TREE"])
        where = os.path.realpath(spillway.__file__)
        if where.startswith(build + os.sep) or "site-packages" not in where:
            raise RuntimeError(f"the tests must import the pip-installed spillway, but imported {where}")


# ctest reports a file with any skipped test as skipped, never as passed (SKIP_RETURN_CODE in
# tests/CMakeLists.txt): a session that would exit 0 but skipped something exits with this code
# instead. Failures keep their own exit status, so a failure next to a skip still fails.
SKIPPED_EXIT = 77


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", ())) if reporter is not None else 0
    if exitstatus == 0 and skipped:
        session.exitstatus = SKIPPED_EXIT
