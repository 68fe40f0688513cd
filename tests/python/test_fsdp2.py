"""torch's FSDP2 with CPUOffloadPolicy on Spillway (spillway.install() + tag scopes), on the CPU with a
Gloo group of one. FSDP2 keeps the sharded parameters, their gradients and the optimizer's state on
the CPU; with tags around sharding, backward and the first step, all three are Spillway's, and the
run is bit-identical to the same run without Spillway. CPUOffloadPolicy(pin_memory=True) pins through
torch's host allocator, which needs CUDA: test_gpu_deepspeed.py runs this file's check on cuda:0 with
NCCL and pinned shards."""
import json
import subprocess
import sys
import textwrap

RUN = """
import json, os, socket, sys, torch, torch.distributed as dist
use, device, pin = sys.argv[1] == "spillway", sys.argv[2], sys.argv[3] == "pin"
if use:
    import spillway
    rt = spillway.install()
    tag = spillway.tag
else:
    import contextlib
    tag = lambda kind: contextlib.nullcontext()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl" if device == "cuda" else "gloo")
from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh(device, (1,))
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                        torch.nn.Linear(512, 8))
policy = CPUOffloadPolicy(pin_memory=pin)
with tag("param"):
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(m, mesh=mesh, offload_policy=policy)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
losses = []
for step in range(4):
    x = torch.randn(16, 64, generator=g).to(device)
    loss = m(x).square().mean()
    with tag("grad"):
        loss.backward()
    with tag("optimizer_state"):
        opt.step()
    opt.zero_grad(set_to_none=False)
    losses.append(loss.item())
out = {"losses": losses}
if device == "cuda":  # torch's own pinned cache: held against asked (a plain run's pins are all there)
    from spillway.leak_suite import torch_pinned_cache
    out["torch_pinned"] = torch_pinned_cache(torch)
if use:
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    def share(tensors):
        ts = [local(t) for t in tensors]
        total = sum(t.untyped_storage().nbytes() for t in ts)
        ours = sum(t.untyped_storage().nbytes() for t in ts
                   if any(a.contains(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                          for a in (rt.host, rt.pinned)))
        return ours, total
    params = list(m.parameters())
    out["params"] = share(params)
    out["grads"] = share([p.grad for p in params])
    out["state"] = share([opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")])
    out["kinds"] = rt.host.stats()["live_by_kind"]
    out["pinned"] = {k: rt.pinned.stats()[k] for k in ("live_bytes", "committed_bytes", "retained_bytes")}
    out["params_pinned"] = all(local(p).is_pinned() for p in params)
print(json.dumps(out))
"""


def run(which, device="cpu", pin=False):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(RUN), which, device, "pin" if pin else "pageable"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-5000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_fsdp2_cpu_offload_keeps_params_grads_and_optimizer_state_in_spillways_arena():
    check_fsdp2_offload("cpu", pin=False)


def check_fsdp2_offload(device, pin):
    """The plain run and Spillway's, on `device` (cpu: Gloo; cuda: NCCL, the compute on cuda:0), the
    shards pinned or not. Returns both runs' results."""
    plain, ours = run("plain", device, pin), run("spillway", device, pin)
    assert ours["losses"] == plain["losses"], (ours["losses"], plain["losses"])
    for what in ("params", "grads", "state"):
        covered, total = ours[what]
        assert total > 0 and covered >= 0.99 * total, (what, covered, total, ours["kinds"])
    kinds = ours["kinds"]
    assert kinds["optimizer_state"] > 0, kinds
    assert kinds["param"] > 0 or (pin and ours["pinned"]["live_bytes"] > 0), (kinds, ours["pinned"])
    if pin:
        assert ours["params_pinned"], "CPUOffloadPolicy(pin_memory=True) left a shard unpinned"
    return plain, ours
