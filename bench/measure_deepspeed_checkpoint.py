#!/usr/bin/env python3
"""Host memory of DeepSpeed's own checkpoints (engine.save_checkpoint / load_checkpoint), plain and
after spillway.deepspeed.install(), each run a process of its own: the measurement issue 38 starts
from (docs/deepspeed.md, "DeepSpeed's own checkpoints").

    PYTHONPATH=build/default/python python3 bench/measure_deepspeed_checkpoint.py [--params 9.7e6]
        [--saves 6] [--steps-between 2] [--stages 3 2] [--dir DIR]

Per run: ZeRO-3 (or ZeRO-2) with the optimizer state (and for ZeRO-3 the parameters) offloaded to
the CPU, bf16, DeepSpeed's CPU accelerator, an MLP of --params parameters; --saves saves, a tag
each (t0, t1, ...), --steps-between steps apart; then a fresh engine in a new process loads the
last one (`latest`). A thread samples the process's anonymous RSS (RssAnon in /proc/self/status)
every millisecond while each save and load runs. Printed per run: the offloaded state, the
anonymous RSS after each save minus before the first, the peak during each save and during the load
over the RSS just before it, what the load left behind, and the seconds of each save and of the
load (the memory numbers do not depend on the machine's load; the seconds do, and the plain and
Spillway runs are sequential, not interleaved).
Last line: one JSON object.

With --rounds N (one stage, and --dir on the disk to measure) it times instead, interleaved: each
round saves a checkpoint plain and with Spillway (the order alternating between rounds, each save
a process of its own), writes and reads a file of the same bytes with fio (O_DIRECT, io_uring,
1 MiB blocks, 32 in flight, fsync at the end: the disk's sequential rate in that directory), then
loads both checkpoints into fresh engines (with --cold the page cache dropped before each load and
each fio read). Printed: the medians of
each, the per-round ratios with their spread, and Spillway's save rate against fio's write rate.
Every timed save, load and fio run starts after a sync (no earlier write still in flight).
Needs fio (scripts/install-deps installs it)."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from _fio import fio_job  # bench/ is first on sys.path (ds_checkpoint.py puts it there too)

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def status(key):
    """A field of /proc/self/status in bytes (RssAnon, RssFile, VmRSS, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def rss_anon():
    return status("RssAnon")


class Peak:
    """The highest RssAnon (peak) and RssFile (file_peak) seen while the `with` block runs, sampled
    every millisecond; before/after and file_before are the RssAnon and RssFile around it."""

    def __enter__(self):
        self.before, self.file_before = rss_anon(), status("RssFile")
        self.peak, self.file_peak = self.before, self.file_before
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            self.file_peak = max(self.file_peak, status("RssFile"))
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.after = rss_anon()
        self.peak = max(self.peak, self.after)


def worker(a):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python", "workers"))
    import torch  # noqa: PLC0415

    if a.spillway:
        import spillway.deepspeed  # noqa: PLC0415

        spillway.deepspeed.install()
    import deepspeed  # noqa: PLC0415
    from _dist import world_from_env_or_single  # noqa: PLC0415

    from spillway.leak_suite import build_model  # noqa: PLC0415 (the leak suite's MLP, scaled to --params)

    world_from_env_or_single()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    zero = {"stage": a.stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if a.stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "bf16": {"enabled": True}, "zero_optimization": zero}
    torch.manual_seed(0)
    model = build_model(int(float(a.params)), torch)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    from spillway.deepspeed import offloaded_tensors  # noqa: PLC0415

    def step():
        x = torch.randn(8, 64).to(torch.bfloat16)
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()

    out = {"stage": a.stage, "spillway": a.spillway, "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                                                    for p in model.parameters())}
    if a.mode == "save":
        step()  # the moments exist
        out["state_bytes"] = sum(t.untyped_storage().nbytes() for _n, _k, t in offloaded_tensors(engine))
        base = rss_anon()
        out["saves"] = []
        for _ in range(a.saves):
            for _s in range(a.steps_between):
                step()
            t0 = time.perf_counter()
            with Peak() as p:
                engine.save_checkpoint(a.dir, tag=f"t{len(out['saves'])}")
            out["saves"].append({"after": p.after - base, "peak_over_before": p.peak - p.before,
                                 "seconds": time.perf_counter() - t0})
    else:
        step()
        t0 = time.perf_counter()
        with Peak() as p:
            engine.load_checkpoint(a.dir)  # `latest`: the last save
        out["state_bytes"] = sum(t.untyped_storage().nbytes() for _n, _k, t in offloaded_tensors(engine))
        out["load"] = {"peak_over_before": p.peak - p.before, "left": p.after - p.before,
                       "seconds": time.perf_counter() - t0}
    print(json.dumps(out))


def run(a, stage, spillway, mode, d):
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", mode, "--stage", str(stage), "--params", a.params,
           "--saves", str(a.saves), "--steps-between", str(a.steps_between), "--dir", d]
    if spillway:
        cmd.append("--spillway")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        raise SystemExit(f"the {mode} run (stage {stage}, spillway={spillway}) failed (exit {p.returncode})")
    return json.loads(p.stdout.strip().splitlines()[-1])


def drop_page_cache():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        raise SystemExit(f"--cold: cannot drop the page cache ({e}); run as root, or without --cold")


def settle(cold):
    """Before a timed step: no earlier write still in flight under it, and with `cold` the page
    cache dropped (drop_page_cache syncs first)."""
    if cold:
        drop_page_cache()
    else:
        os.sync()


def fio_seconds(directory, nbytes, rw, cold):
    """fio's own runtime for one sequential pass of `nbytes` in `directory` (rw "write": a new file,
    fsynced at the end; "read": the file the write left)."""
    settle(cold and rw == "read")
    job = fio_job(["--name=seq", f"--directory={directory}", f"--rw={rw}", "--bs=1M", "--iodepth=32",
                   "--ioengine=io_uring", "--direct=1", f"--size={nbytes}", "--end_fsync=1"],
                  f"{rw} {nbytes} bytes in {directory}")
    return job["job_runtime"] / 1e3


def tree_size(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(d) for f in fs)


def one_round(a, stage, r, t):
    """One round of --rounds into `t`: both saves, fio's write and read, both loads. Returns the
    bytes Spillway's save wrote. Everything it made under --dir is removed, whatever fails."""
    made = []
    try:
        dirs = {}
        for spillway in ((False, True) if r % 2 == 0 else (True, False)):
            name = "spillway" if spillway else "plain"
            dirs[name] = tempfile.mkdtemp(prefix=f"ds-ckpt-{name}-", dir=a.dir)
            made.append(dirs[name])
            settle(False)  # the other save's buffered writes are on the disk before this one starts
            t[f"save {name}"].append(run(a, stage, spillway, "save", dirs[name])["saves"][0]["seconds"])
        nbytes = tree_size(dirs["spillway"])
        made.append(tempfile.mkdtemp(prefix="fio-", dir=a.dir))
        t["fio write"].append(fio_seconds(made[-1], nbytes, "write", a.cold))
        t["fio read"].append(fio_seconds(made[-1], nbytes, "read", a.cold))
        for name in (("plain", "spillway") if r % 2 == 0 else ("spillway", "plain")):
            settle(a.cold)
            t[f"load {name}"].append(run(a, stage, name == "spillway", "load", dirs[name])["load"]["seconds"])
        return nbytes
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


def rounds(a):
    """--rounds: save and load times interleaved, with fio's rates beside them."""
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (scripts/install-deps installs it): it is the disk's yardstick")
    if len(a.stages) != 1 or a.dir is None:
        raise SystemExit("--rounds times one stage (--stages 3 or --stages 2) in a directory on the disk to "
                         "measure (--dir: a temporary directory may be a tmpfs, where fio's O_DIRECT fails)")
    if not a.cold:
        print("note: without --cold, plain DeepSpeed's load reads its files from the page cache its save "
              "left them in, and Spillway's from the disk (its saves bypass the page cache)")
    a.saves, a.steps_between = 1, 1
    t = {k: [] for k in ("save plain", "save spillway", "load plain", "load spillway", "fio write", "fio read")}
    sizes = []
    for r in range(a.rounds):
        sizes.append(one_round(a, a.stages[0], r, t))
        print(f"ZeRO-{a.stages[0]} round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in t.items()), flush=True)
    nbytes = statistics.median(sizes)
    med = {k: statistics.median(v) for k, v in t.items()}
    ratio = {op: [p / s for p, s in zip(t[f"{op} plain"], t[f"{op} spillway"])] for op in ("save", "load")}
    vs_fio = [f / s for s, f in zip(t["save spillway"], t["fio write"])]  # same bytes each round
    print(f"\nZeRO-{a.stages[0]}, {nbytes / MIB:.0f} MiB per checkpoint, {a.rounds} rounds"
          f"{' (cold loads)' if a.cold else ''}; medians:")
    for k, v in med.items():
        print(f"  {k:14} {v:6.2f} s  ({min(t[k]):.2f}..{max(t[k]):.2f})")
    for op, xs in ratio.items():
        print(f"  {op}: spillway x{statistics.median(xs):.2f} plain's speed ({min(xs):.2f}..{max(xs):.2f})")
    print(f"  save rate {nbytes / med['save spillway'] / 1e9:.2f} GB/s, fio's sequential write "
          f"{nbytes / med['fio write'] / 1e9:.2f} GB/s: x{statistics.median(vs_fio):.2f} "
          f"({min(vs_fio):.2f}..{max(vs_fio):.2f})")
    print(json.dumps({"bench": "deepspeed_checkpoint_rounds", "stage": a.stages[0], "cold": a.cold, "bytes": sizes,
                      "seconds": t, "save_x": statistics.median(ratio["save"]),
                      "load_x": statistics.median(ratio["load"]), "save_vs_fio_write": statistics.median(vs_fio)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="9.7e6")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--steps-between", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 2])
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before each load (root: /proc/sys/vm/drop_caches), so both read "
                         "from the disk as a job resumed after a restart does")
    ap.add_argument("--rounds", type=int, default=0,
                    help="time saves and loads instead, plain and Spillway alternating, this many rounds, with fio")
    ap.add_argument("--_worker", choices=("save", "load"))
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--spillway", action="store_true")
    a = ap.parse_args()
    if a._worker:
        a.mode = a._worker
        return worker(a)
    if a.rounds:
        return rounds(a)
    results = []
    for stage in a.stages:
        for spillway in (False, True):
            d = tempfile.mkdtemp(prefix="ds-ckpt-", dir=a.dir)
            s = run(a, stage, spillway, "save", d)
            if a.cold:
                drop_page_cache()
            load = run(a, stage, spillway, "load", d)
            s["load"] = load["load"]
            results.append(s)
            name = f"ZeRO-{stage} {'spillway' if spillway else 'plain'}"
            print(f"{name}: {s['params'] / 1e6:.1f}M parameters, offloaded state {s['state_bytes'] / MIB:.1f} MiB")
            print("  RssAnon after each save (MiB over before the first): "
                  + ", ".join(f"{x['after'] / MIB:+.1f}" for x in s["saves"]))
            print("  peak during each save (MiB over just before it):      "
                  + ", ".join(f"{x['peak_over_before'] / MIB:+.1f}" for x in s["saves"]))
            print("  seconds per save:                                      "
                  + ", ".join(f"{x['seconds']:.2f}" for x in s["saves"]))
            print(f"  load_checkpoint into a fresh engine: peak {s['load']['peak_over_before'] / MIB:+.1f} MiB, "
                  f"left {s['load']['left'] / MIB:+.1f} MiB, {s['load']['seconds']:.2f} s")
    print(json.dumps({"bench": "deepspeed_checkpoint_memory", "runs": results}))


if __name__ == "__main__":
    main()
