"""Which children may read what Spillway holds: one row of docs/allocator.md's table "Which children
read what" per test, each with the real component. Spillway keeps its arenas out of forked children
(MADV_DONTFORK, Note [Fork fault] in docs/allocator.md): a forked child that reads them dies with
SIGSEGV after one line that names the arena and the kind; a child that gets the tensor pickled
(spawn, forkserver) reads a copy in shared memory; a thread reads everything; Gloo has no helper
process. The DataLoader's fork workers have their own tests in test_dataloader_fork.py.

Each row runs a script of its own (the child's death is the point), as `python script.py ROW`: a
spawn child imports the script by its path, which `python -c` cannot give it."""
import sys

import _zygote
import pytest

SCRIPT = r'''
import os, subprocess, sys, threading
import torch, spillway
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

# One intra-op thread, as the DataLoader's workers set: a child forked after the parent's first
# parallel op (the expected sum below) ran its own sum into libgomp's pool, which a fork does not
# copy, and hung at its barrier before reading anything (seen once in CI).
torch.set_num_threads(1)


class Reads(Dataset):
    def __init__(self, t):
        self.t = t

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return self.t[i * 1000].clone()


def read(t, q=None):
    total = float(t.sum())
    if q is not None:
        q.put(total)


def gloo_rank(rank, port):
    import torch.distributed as dist
    spillway.install()
    with spillway.tag("grad"):
        g = torch.full((1 << 18,), float(rank + 1))  # 1 MiB of gradient in each rank's arena
    assert spillway.installed().host.contains(g.data_ptr(), g.nbytes)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.all_reduce(g)   # Gloo's own threads read and write the arena tensor
    dist.destroy_process_group()
    assert float(g[0]) == 3.0 and float(g[-1]) == 3.0, float(g[0])


def exit_of(p):
    p.join(120)
    if p.exitcode is None:  # hung: killed, so no orphan keeps the caller's pipes open
        p.kill()
        p.join(30)
        return "hung"
    return p.exitcode


if __name__ == "__main__":
    row = sys.argv[1]
    if row == "gloo":
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(gloo_rank, args=(port,), nprocs=2)
        print("gloo all_reduce over the arena: ok", flush=True)
        sys.exit(0)
    if row == "zero3-partition":
        import socket
        import spillway.deepspeed
        spillway.deepspeed.install()
        import deepspeed
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0",
                              LOCAL_RANK="0", WORLD_SIZE="1")
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                        "offload_optimizer": {"device": "cpu"}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        state = next(engine.module.parameters()).ds_tensor  # this rank's partition of the first weight
        arena = spillway.installed().host
    elif row == "deepspeed-pinned":
        import spillway.deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder
        spillway.deepspeed.install()
        handle = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
        state = handle.new_cpu_locked_tensor(1 << 16, torch.zeros(1, dtype=torch.float32))
        state.fill_(1)
        arena = spillway.installed().pinned
    else:
        rt = spillway.install()
        with spillway.tag("optimizer_state"):
            state = torch.ones(1 << 20)   # 4 MiB of optimizer state in Spillway's host arena
        arena = rt.host
    assert arena.contains(state.data_ptr(), state.nbytes)
    expected = float(state.sum())
    if row == "zero3-partition":
        try:
            for _ in DataLoader(Reads(state), num_workers=1, multiprocessing_context="fork"):
                pass
            print("worker read", flush=True)
        except RuntimeError as e:
            print("worker died:", str(e).splitlines()[0], flush=True)
    elif row in ("mp-fork", "deepspeed-pinned"):
        p = mp.get_context("fork").Process(target=read, args=(state,))
        p.start()
        print("child exit", exit_of(p), flush=True)
    elif row == "mp-spawn":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=read, args=(state, q))
        p.start()
        print("child read", q.get(timeout=120) == expected, "exit", exit_of(p), flush=True)
    elif row in ("loader-forkserver", "loader-spawn"):
        got = [float(b) for b in DataLoader(Reads(state), num_workers=1, multiprocessing_context=row[7:])]
        print("worker read", got == [1.0, 1.0], flush=True)
    elif row == "thread":
        q = mp.get_context("fork").SimpleQueue()
        t = threading.Thread(target=read, args=(state, q))
        t.start()
        t.join()
        print("thread read", q.get() == expected, flush=True)
    elif row == "exec":
        out = subprocess.run([sys.executable, "-c", "print('exec ok')"], capture_output=True, text=True)
        print("exec child", out.stdout.strip(), "exit", out.returncode, flush=True)
    # Where the parent's tensor is now: pickling it to a spawn or forkserver child moves its storage
    # into shared memory (torch.multiprocessing's share_memory_()), out of the arena.
    print("parent's tensor in the arena:", arena.contains(state.data_ptr(), state.nbytes),
          "shared:", state.is_shared(), "same values:", float(state.sum()) == expected, flush=True)
'''


def run_row(tmp_path, row):
    script = tmp_path / "child_access.py"
    script.write_text(SCRIPT)
    p = _zygote.run([sys.executable, str(script), row], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    said = [line for line in p.stderr.splitlines() if line.startswith("spillway: process")]
    return p.stdout, said, p.stderr


@pytest.mark.parametrize("row", ["mp-fork", "deepspeed-pinned"])
def test_a_forked_child_that_reads_kept_out_state_dies_by_segv_after_one_named_line(tmp_path, row):
    """A torch.multiprocessing fork child handed a tensor of the host arena, and one handed a pinned
    buffer DeepSpeed's aio handle made (new_cpu_locked_tensor: the pinned arena), die as they would
    have without Spillway's line (SIGSEGV, exit -11), after one line naming the arena and the kind.
    The parent's tensor is untouched."""
    if row == "deepspeed-pinned":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
    out, said, err = run_row(tmp_path, row)
    assert "child exit -11" in out, out + err[-3000:]
    arena, kind = ("pinned", "swap_buffer") if row == "deepspeed-pinned" else ("host", "optimizer_state")
    assert len(said) == 1, err[-3000:]
    assert f"host arena '{arena}'" in said[0] and f"first mapped for {kind}" in said[0], said[0]
    assert "parent's tensor in the arena: True shared: False same values: True" in out, out


def test_a_dataloader_worker_that_reads_a_zero3_parameter_partition_dies_by_segv_after_one_named_line(tmp_path):
    """The case users meet: under spillway.deepspeed.install(), a fork DataLoader worker whose dataset
    holds this rank's ZeRO-3 partition of a weight (offload_param cpu: the host arena, kind param)
    reads it: the worker's stderr has Spillway's line naming the arena and the kind, then torch's
    own (its SIGSEGV handler's), and the DataLoader reports the worker's death, as it would without
    the line. The
    fault elsewhere and the copy made outside spillway.tag() are test_dataloader_fork.py's."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
    out, said, err = run_row(tmp_path, "zero3-partition")
    assert "worker died:" in out and "exited unexpectedly" in out, out + err[-3000:]
    assert len(said) == 1, err[-3000:]
    assert "host arena 'host'" in said[0] and "first mapped for param" in said[0], said[0]
    torchs = [line for line in err.splitlines() if "Unexpected segmentation fault encountered in worker" in line]
    assert torchs and err.index(said[0]) < err.index(torchs[0]), err[-3000:]
    assert "parent's tensor in the arena: True shared: False same values: True" in out, out


@pytest.mark.parametrize("row", ["mp-spawn", "loader-forkserver", "loader-spawn"])
def test_a_spawn_or_forkserver_child_reads_a_shared_copy_and_torch_moves_the_parents_tensor(tmp_path, row):
    """A child that gets the tensor pickled (torch.multiprocessing's spawn, a forkserver or spawn
    DataLoader worker whose dataset holds it) reads it: torch moves the storage into shared memory for the
    pickle (share_memory_()), so the parent's tensor leaves the arena for /dev/shm with its values,
    where Spillway's memory by owner counts it as shared. Nothing is said and nothing dies."""
    out, said, err = run_row(tmp_path, row)
    assert said == [], err[-3000:]
    assert ("child read True exit 0" if row == "mp-spawn" else "worker read True") in out, out + err[-3000:]
    assert "parent's tensor in the arena: False shared: True same values: True" in out, out


@pytest.mark.parametrize("row", ["thread", "exec", "gloo"])
def test_threads_exec_children_and_gloo_read_the_arena_as_the_process_does(tmp_path, row):
    """What shares the address space reads everything: a thread (the DataLoader's pin-memory thread
    is one), Gloo (its collectives run on threads of the rank: it has no helper process; two ranks
    all_reduce a gradient tensor of their arenas), and a child that execs at once (subprocess,
    DeepSpeed's JIT builds) touches nothing of the parent's."""
    out, said, err = run_row(tmp_path, row)
    assert said == [], err[-3000:]
    expected = {"thread": "thread read True", "exec": "exec child exec ok exit 0",
                "gloo": "gloo all_reduce over the arena: ok"}[row]
    assert expected in out, out + err[-3000:]
    if row != "gloo":
        assert "parent's tensor in the arena: True shared: False same values: True" in out, out
