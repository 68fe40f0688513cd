"""The leak regression suite for your own DeepSpeed config:

    python -m spillway.leak_suite --deepspeed ds_config.json [--params N] [--epochs K] [--workers W]
                                  [--steps S] [--start-method fork|forkserver|spawn]
                                  [--accelerator cpu|cuda] [--png out.png] [--json out.json]

Runs the ZeRO config through the real DeepSpeed on an MLP scaled to N parameters, K epochs, with a
DataLoader that starts W workers at every epoch (persistent_workers=False, the default that re-makes
them: the Yi-34B pattern) with the given start method (fork, the default before Python 3.14), once on
plain DeepSpeed and once after spillway.deepspeed.install(), each in a process of its own. Prints, per
epoch, what the workers' start added to the process tree's anonymous PSS and how long their first
batch took, what the first optimizer step after that added (the copy-on-write cost under fork), the
first step's time next to the median step's, and whether the losses are identical; writes a PNG.
Exits 1 when Spillway's run grows (the rule, and why epoch 0 is shown but not judged, is in
verdict()). docs/deepspeed.md explains the numbers.
"""
import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from . import _torch_allocators
from . import deepspeed as _sd
from . import metrics as _metrics
from . import node as _node

MIB = 1 << 20


# Measuring a process tree (the tests use these too).

def tree_pss_anon(root=None):
    """Pss_Anon summed over a process and its descendants (smaps_rollup), in bytes."""
    total, stack = 0, [root or os.getpid()]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss_Anon:"):
                        total += int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError):
            continue
        stack += _node.children(pid)
    return total


def dontfork_ranges():
    """[start, end) of this process's mappings whose VmFlags carry `dc` ("do not copy area on
    fork", what MADV_DONTFORK sets; `dd` is MADV_DONTDUMP, proc(5)), sorted."""
    ranges, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = head.split("-")
                current = (int(lo, 16), int(hi, 16))
            elif head == "VmFlags:" and current is not None and "dc" in line.split()[1:]:
                ranges.append(current)
    ranges.sort()
    return ranges


def bytes_in_ranges(ptr, nbytes, ranges):
    """How many of [ptr, ptr + nbytes) lie in `ranges`."""
    covered = 0
    for lo, hi in ranges:
        if hi <= ptr or lo >= ptr + nbytes:
            continue
        covered += min(hi, ptr + nbytes) - max(lo, ptr)
    return covered


# One run, in a process of its own: DeepSpeed's comm and the install are process-wide.

def torch_pinned_cache(torch):
    """torch's own pinned cache (CachingHostAllocator), in bytes: held (active + cached) and active,
    both counted at the blocks' power-of-two sizes, and the peak held. Needs a CUDA torch."""
    hs = torch.cuda.host_memory_stats()
    return {"held_bytes": hs.get("allocated_bytes.current", 0), "active_bytes": hs.get("active_bytes.current", 0),
            "peak_held_bytes": hs.get("allocated_bytes.peak", 0)}


def build_model(params, torch):
    d_in, d_out, hidden = 64, 8, (1024 if params >= 4 * MIB else 256)
    layers = max(1, round((params - d_in * hidden - hidden * d_out) / (hidden * hidden + hidden)))
    mods = [torch.nn.Linear(d_in, hidden), torch.nn.GELU()]
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    mods.append(torch.nn.Linear(hidden, d_out))
    return torch.nn.Sequential(*mods)


def worker(args):
    os.environ["DS_ACCELERATOR"] = args.accelerator
    import torch  # noqa: PLC0415
    import deepspeed  # noqa: PLC0415

    with_spillway = args.worker == "spillway"
    if with_spillway:
        # DeepSpeed's own optimizer step: this suite measures memory and compares the losses of the
        # two runs bit for bit. The fused step has its own equivalence test (test_deepspeed_step.py).
        _sd.install(budget_bytes=args.budget_bytes or None, step=False)
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
    # On CUDA, ZeRO-3 gathers device tensors: NCCL; on DeepSpeed's CPU accelerator, Gloo.
    deepspeed.init_distributed(dist_backend="nccl" if args.accelerator == "cuda" else "gloo",
                               auto_mpi_discovery=False)
    with open(args.deepspeed) as f:
        config = json.load(f)
    config.setdefault("train_micro_batch_size_per_gpu", 8)
    micro = config["train_micro_batch_size_per_gpu"]
    accum = config.get("gradient_accumulation_steps", 1)
    torch.manual_seed(0)
    model = build_model(args.params, torch)
    n_params = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    exporter = _metrics.serve("127.0.0.1:0") if with_spillway and args.metrics else None
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else (
        torch.float16 if config.get("fp16", {}).get("enabled") else torch.float32)

    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(64, 8, generator=g)
    xs = torch.randn(args.steps * accum * micro, 64, generator=g)
    ys = (xs @ teacher).argmax(dim=1)
    data = torch.utils.data.TensorDataset(xs, ys)  # made before any fork: workers read it
    loader = torch.utils.data.DataLoader(data, batch_size=micro, num_workers=args.workers,
                                         persistent_workers=False,
                                         multiprocessing_context=args.start_method if args.workers else None)
    epochs, losses = [], []
    scrape = None
    for epoch in range(args.epochs):
        if with_spillway:
            _torch_allocators.next_epoch()
        # Both runs: move the interpreter's objects out of the collector's reach before the fork, so
        # a collection during the step does not copy the whole Python heap (noise that is not
        # DeepSpeed's state; the same advice applies to any fork-based DataLoader).
        gc.collect()
        gc.freeze()
        step_times, growth, t0, before, first_batch_s, workers_bytes = [], None, None, None, 0.0, 0
        # What starting the workers costs (the fork's page tables, or an interpreter each under
        # forkserver and spawn, which also pickle the dataset to them): tree PSS and the time to
        # the first batch.
        unstarted, t_start = tree_pss_anon(), time.perf_counter()
        for i, (x, y) in enumerate(loader):
            if i % accum == 0:
                if i == 0:
                    first_batch_s = time.perf_counter() - t_start
                    # The workers are alive and fetched the first batch. Let them finish their
                    # prefetching (their own refcount writes copy pages too), then what the first
                    # step adds is the copy-on-write of pages the workers still share.
                    time.sleep(args.settle)
                    state_at_fork = sum(t.untyped_storage().nbytes() for _n, _k, t in _sd.offloaded_tensors(engine))
                    before = tree_pss_anon()
                    workers_bytes = before - unstarted
                t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(engine(x.to(engine.device, dtype)).float(), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if (i + 1) % accum == 0:
                step_times.append(time.perf_counter() - t0)
                if growth is None:
                    growth = tree_pss_anon() - before
                    if exporter is not None and scrape is None:
                        scrape = _scrape(exporter.port)
        epochs.append({"epoch": epoch, "first_step_growth_bytes": growth, "state_at_fork_bytes": state_at_fork,
                       "workers_start_bytes": workers_bytes, "first_batch_s": first_batch_s,
                       "first_step_s": step_times[0],
                       "median_step_s": statistics.median(step_times), "steps": len(step_times),
                       "boundary_pss_bytes": tree_pss_anon()})
    state = _sd.offloaded_tensors(engine)
    ranges = dontfork_ranges()
    by_kind, dd_bytes, total = {}, 0, 0
    for _name, kind, t in state:
        s = t.untyped_storage()
        by_kind[kind] = by_kind.get(kind, 0) + s.nbytes()
        total += s.nbytes()
        dd_bytes += bytes_in_ranges(s.data_ptr(), s.nbytes(), ranges)
    out = {"run": args.worker, "params": n_params, "deepspeed": deepspeed.__version__,
           "accelerator": f"{args.accelerator} ({engine.device})", "epochs": epochs,
           "losses": losses, "offloaded_bytes": total, "offloaded_by_kind": by_kind,
           "dontfork_bytes": dd_bytes, "offloaded_names": [name for name, _k, _t in state]}
    if args.accelerator == "cuda":
        # What plain DeepSpeed's pins hold in torch's cache; Spillway's run reports its arena's (below).
        out["torch_pinned"] = torch_pinned_cache(torch)
    # What the offloaded state asked for in pinned memory, in either run.
    out["pinned_state_bytes"] = sum(t.untyped_storage().nbytes() for _n, _k, t in state if t.is_pinned())
    if with_spillway:
        runtime = _torch_allocators.installed()
        out["audit"] = _sd.audit(engine)
        out["arena"] = runtime.host.stats()
        out["pinned"] = runtime.pinned.stats()
        out["router"] = runtime.stats()["router"]
        out["last_epoch_report"] = runtime.next_epoch()
        out["scrape"] = scrape
    print(json.dumps(out))


def _scrape(port):
    """Spillway's live bytes by kind from a scrape of the running exporter (text exposition)."""
    import urllib.request  # noqa: PLC0415

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = {}
    for line in body.splitlines():
        if line.startswith("spillway_live_bytes_by_kind{"):
            labels, value = line.rsplit(" ", 1)
            fields = dict(kv.split("=", 1) for kv in labels[labels.index("{") + 1:-1].split(","))
            fields = {k: v.strip('"') for k, v in fields.items()}
            found[f"{fields['arena']}/{fields['kind']}"] = float(value)
            found["rank"] = fields.get("rank", "")
    return found


# The comparison: both runs, the verdict, the table and the plot.

def run_one(which, args):
    cmd = [sys.executable, "-m", "spillway.leak_suite", "--_worker", which, "--deepspeed", args.deepspeed,
           "--params", str(args.params), "--epochs", str(args.epochs), "--workers", str(args.workers),
           "--steps", str(args.steps), "--settle", str(args.settle), "--accelerator", args.accelerator,
           "--start-method", args.start_method]
    if args.budget_bytes:
        cmd += ["--budget-bytes", str(args.budget_bytes)]
    if args.metrics:
        cmd.append("--metrics")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-8000:])
        raise SystemExit(f"leak_suite: the {which} run failed (exit {p.returncode}); its output is above")
    return json.loads(p.stdout.strip().splitlines()[-1])


def verdict(plain, ours, min_removed=0.95, start_method="fork"):
    """(ok, lines). Per epoch, what the workers' start and then the first step added in each run.
    Judged on the epochs after the first (epoch 0's first step also makes the Adam moments and
    DeepSpeed's first-step buffers: fresh memory in both runs, not copy-on-write), by their median,
    because the rest of the growth (the interpreter's and the simulated device's pages) moves by tens
    of MiB from epoch to epoch. Under fork, Spillway's run grows when the median of (plain -
    spillway) is below `min_removed` (default 95%) of the offloaded state that existed at the fork,
    and Spillway's own median growth is above 5% of it. Under forkserver and spawn the workers share
    no page with the trainer, so there is no copy to remove in either run: Spillway's run grows when
    its median is above plain's (or zero, where plain's first step freed more than it took) by more
    than 5% of the state."""
    lines, saved, states, ours_growth, plain_growth = [], [], [], [], []
    for pe, se in zip(plain["epochs"], ours["epochs"]):
        pg, sg = pe["first_step_growth_bytes"], se["first_step_growth_bytes"]
        if pe["epoch"] > 0:
            saved.append(pg - sg)
            states.append(se["state_at_fork_bytes"])
            ours_growth.append(sg)
            plain_growth.append(pg)
        lines.append(f"  epoch {pe['epoch']}: starting the workers added {pe['workers_start_bytes'] / MIB:.1f} MiB "
                     f"plain, {se['workers_start_bytes'] / MIB:.1f} MiB spillway (first batch {pe['first_batch_s']:.2f}/"
                     f"{se['first_batch_s']:.2f} s); the first step after it {pg / MIB:.1f} MiB plain, "
                     f"{sg / MIB:.1f} MiB spillway; first/median step {pe['first_step_s']:.3f}/"
                     f"{pe['median_step_s']:.3f} s plain, {se['first_step_s']:.3f}/{se['median_step_s']:.3f} s "
                     f"spillway{'' if pe['epoch'] > 0 else '  (shown, not judged)'}")
    if not saved:
        return True, lines + ["  (one epoch only: nothing to judge; run --epochs 3 or more)"]
    m_saved, m_state = statistics.median(saved), statistics.median(states)
    if m_state == 0:  # nothing to weigh the growth against: no verdict is a pass
        return False, lines + ["  spillway.deepspeed.offloaded_tensors found none of DeepSpeed's offloaded host state "
                               "at the fork: this config's ZeRO stage or offload is not one the audit reads, so "
                               "nothing can be judged"]
    if start_method != "fork":
        m_ours, m_plain = statistics.median(ours_growth), statistics.median(plain_growth)
        lines.append(f"  median over epochs 1..: the first step added {m_plain / MIB:.1f} MiB plain and "
                     f"{m_ours / MIB:.1f} MiB spillway against {m_state / MIB:.1f} MiB of offloaded state: "
                     f"{start_method} workers share no page with the trainer, so neither run copies it "
                     f"(spillway at most 5% of the state above plain passes)")
        return m_ours <= max(m_plain, 0) + 0.05 * m_state, lines
    ok = not (m_saved < min_removed * m_state and statistics.median(ours_growth) > 0.05 * m_state)
    lines.append(f"  median over epochs 1..: Spillway removed {m_saved / MIB:.1f} MiB of the plain run's "
                 f"growth; the offloaded state at the fork was {m_state / MIB:.1f} MiB "
                 f"({m_saved / max(m_state, 1):.0%}; at least {min_removed:.0%} passes)")
    return ok, lines


def plot(plain, ours, path):
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        return "no PNG: gnuplot is not installed (apt-get install gnuplot-nox)"
    with tempfile.NamedTemporaryFile("w", suffix=".dat", delete=False) as f:
        for pe, se in zip(plain["epochs"], ours["epochs"]):
            f.write(f"{pe['epoch']} {pe['first_step_growth_bytes'] / MIB} {se['first_step_growth_bytes'] / MIB}\n")
        dat = f.name
    script = (f"set terminal pngcairo size 800,480; set output '{path}'; set style data histogram; "
              f"set style fill solid; set ylabel 'MiB'; set xlabel 'epoch'; "
              f"set title 'First step after the DataLoader fork: tree anonymous PSS growth'; "
              f"plot '{dat}' using 2:xtic(1) title 'plain DeepSpeed', '' using 3 title 'Spillway'")
    r = subprocess.run([gnuplot, "-e", script], capture_output=True, text=True)
    os.unlink(dat)
    return f"wrote {path}" if r.returncode == 0 else f"no PNG: gnuplot failed: {r.stderr.strip()[:300]}"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m spillway.leak_suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--deepspeed", required=True, help="a DeepSpeed config (JSON) with zero_optimization")
    ap.add_argument("--params", type=float, default=8.5e6, help="model size in parameters (default 8.5e6)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers started per epoch")
    ap.add_argument("--start-method", choices=("fork", "forkserver", "spawn"), default="fork",
                    help="the DataLoader's multiprocessing context (default fork, Linux's default before "
                         "Python 3.14, the one whose first step copies the state)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per epoch")
    ap.add_argument("--budget-bytes", type=int, default=0, help="Spillway's host budget (0: the default)")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds the forked workers get to finish prefetching before the measurement")
    ap.add_argument("--min-removed", type=float, default=0.95,
                    help="fraction of the offloaded state Spillway must remove from the plain run's growth")
    ap.add_argument("--metrics", action="store_true", help="scrape Spillway's exporter during the run")
    ap.add_argument("--accelerator", choices=("cpu", "cuda"),
                    default="cuda" if os.environ.get("DS_ACCELERATOR") == "cuda" else "cpu",
                    help="DeepSpeed's accelerator: cpu (its CPU accelerator, no GPU needed; the default unless "
                         "DS_ACCELERATOR=cuda) or cuda")
    ap.add_argument("--png", default="leak_suite.png")
    ap.add_argument("--json", default=None, help="write both runs' measurements here")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--_worker", dest="worker", choices=("plain", "spillway"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.params = int(args.params)
    if not os.path.exists(args.deepspeed):
        ap.error(f"--deepspeed {args.deepspeed}: no such file")
    if args.epochs < 1 or args.steps < 1 or args.workers < 0:
        ap.error("--epochs and --steps must be at least 1 and --workers at least 0")
    if args.accelerator == "cuda" and not args.worker:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            ap.error(f"--accelerator cuda: torch {torch.__version__} sees no CUDA device; run on a GPU machine "
                     "with a CUDA build of torch, or use --accelerator cpu")
    if args.worker:
        worker(args)
        return 0
    plain = run_one("plain", args)
    ours = run_one("spillway", args)
    # Without workers nothing starts, and the fork rule (nothing to remove) judges.
    ok, lines = verdict(plain, ours, args.min_removed, args.start_method if args.workers else "fork")
    state = ours["offloaded_bytes"]
    print(f"spillway leak suite: {args.deepspeed}, {ours['params']} parameters, DeepSpeed {ours['deepspeed']} "
          f"on its {ours['accelerator']} accelerator, {args.epochs} epochs, {args.workers} workers started by "
          f"{args.start_method}")
    print(f"  DeepSpeed's offloaded host state: {state / MIB:.1f} MiB "
          + ", ".join(f"{k} {v / MIB:.1f}" for k, v in sorted(ours["offloaded_by_kind"].items())))
    print(f"  in MADV_DONTFORK pages: plain {plain['dontfork_bytes'] / max(plain['offloaded_bytes'], 1):.1%}, "
          f"spillway {ours['dontfork_bytes'] / max(state, 1):.1%}")
    print("\n".join(lines))
    same = plain["losses"] == ours["losses"]
    print(f"  losses identical bit for bit: {same}")
    print("  " + plot(plain, ours, args.png))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain": plain, "spillway": ours, "ok": ok, "losses_identical": same,
                       "start_method": args.start_method}, f)
    print("PASS: Spillway's run does not grow" if ok else "FAIL: Spillway's run grows (see the epochs above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
