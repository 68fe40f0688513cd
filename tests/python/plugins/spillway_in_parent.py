"""pytest plugin for scripts/deepspeed-aio-unit-tests: spillway.deepspeed.install() in the pytest process,
DeepSpeed's ranks forked from it, and a line per aio handle made (SPILLWAY_HANDLE_LOG) saying in
which process."""
import os


def pytest_configure(config):
    import spillway
    import spillway.deepspeed as sd
    sd.install()
    made = sd._aio_handle

    def counted(*args, **kwargs):  # each handle a test makes, in whichever process, leaves a line
        with open(os.environ["SPILLWAY_HANDLE_LOG"], "a") as f:
            f.write(f"{os.getpid()} {'child' if spillway._spillway._forked_after_install() else 'parent'}\n")
        return made(*args, **kwargs)

    sd._aio_handle = counted


def pytest_sessionstart(session):
    # DeepSpeed's harness starts its ranks with forkserver (a fresh interpreter, without the
    # parent's install); the harness of 0.19.8's era, fork-start pools and some launchers fork.
    # Fork here, so every rank is a forked child of the installed parent.
    import multiprocessing
    import torch.multiprocessing as tmp

    original = multiprocessing.set_start_method

    def fork_instead(method, force=False):
        return original("fork" if method == "forkserver" else method, force=force)

    multiprocessing.set_start_method = fork_instead
    tmp.set_start_method = fork_instead
