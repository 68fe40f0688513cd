"""fio for the Python benchmarks: one job run, its JSON read back. Private to bench/ (each script
runs with bench/ first on sys.path)."""
import contextlib
import json
import subprocess


def fio_job(args, what):
    """Runs `fio ARGS --output-format=json` and returns its first job's JSON. Raises SystemExit naming
    `what` (what fio was asked to do, and where) when fio exits non-zero, prints no job, or reports a
    job error; fio may print warnings before its JSON, which are skipped."""
    p = subprocess.run(["fio", *args, "--output-format=json"], capture_output=True, text=True)
    job = None
    if p.returncode == 0:
        with contextlib.suppress(ValueError, KeyError, IndexError):
            job = json.JSONDecoder().raw_decode(p.stdout, p.stdout.index("{"))[0]["jobs"][0]
    if job is None or job.get("error"):
        raise SystemExit(f"fio failed (exit {p.returncode}, job error {job and job.get('error')}) to {what}:\n"
                         f"{p.stderr[:2000]}{p.stdout[:2000]}")
    return job
