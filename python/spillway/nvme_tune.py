"""DeepSpeed's NVMe tuning tools on Spillway's aio op:

    python -m spillway.nvme_tune --nvme_dir /nvme/dir [ds_nvme_tune's options]   # the sweep
    python -m spillway.nvme_tune --ds-io [ds_io's options]                       # one ds_io run

`ds_nvme_tune` measures DeepSpeed's aio op over a sweep of block sizes, queue depths, submission
modes and parallelism, running each point as a `ds_io` process, and prints the best settings for
the `aio` section of a DeepSpeed config. Run this way, each `ds_io` process (and the processes it
spawns) first calls spillway.deepspeed.install(), so the numbers are those of the op a training run
with Spillway uses: DeepSpeed's `aio_handle`, and the one-shot `aio_read` / `aio_write` of its
`aio_basic` engine. Arguments are DeepSpeed's own (ds_nvme_tune --help, ds_io --help).
docs/deepspeed.md, "DeepSpeed's aio module".
"""
import os
import shlex
import sys

from . import deepspeed as _sd

_DS_IO = "--ds-io"


def _install():
    if not _sd.installed():
        _sd.install()


# ds_io's worker pool starts with 'spawn': each worker imports this module as its main module
# (__mp_main__), and must install Spillway too before DeepSpeed's op is loaded there.
if __name__ == "__mp_main__":
    _install()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    _install()
    if argv[:1] == [_DS_IO]:
        from deepspeed.nvme import ds_io_main  # noqa: PLC0415
        from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415

        print(f"aio op: {AsyncIOBuilder().load(verbose=False).__name__}", flush=True)  # the log says whose
        sys.argv = ["ds_io"] + argv[1:]
        ds_io_main()
        return 0
    from deepspeed.nvme import generate_main, parse_sweep_arguments, perf_run_sweep, sweep_main  # noqa: PLC0415

    # Each sweep point is a command line: this module with --ds-io, run by the same interpreter. An
    # absolute path is what perf_run_sweep's os.path.join(script_path(), PERF_SCRIPT) keeps as is.
    perf_run_sweep.PERF_SCRIPT = f"{shlex.quote(sys.executable)} -m spillway.nvme_tune {_DS_IO}"
    sys.argv = ["ds_nvme_tune"] + argv
    args = parse_sweep_arguments()
    print(f"Running DeepNVMe performance tuning on {args.nvme_dir}, on Spillway's aio op")
    sweep_main(args)
    generate_main(args.log_dir)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
