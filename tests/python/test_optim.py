"""spillway.optim.FusedAdamW against torch.optim.AdamW, the reference it claims to compute.

The bound is adamw_torch_test.cc's: the fused pass and torch's foreach AdamW round differently in the
last bit of each element, so over 30 steps the weights may drift by a few ulp: 4e-7 * (1 + |w|)."""
import copy
import math
import os
import subprocess
import sys

import pytest
import torch

import spillway
from spillway.optim import FusedAdamW


def close(a, b, bound=4e-7):
    return ((a - b).abs() <= bound * (1 + a.abs())).all().item()


def twins(seed=0, shapes=((300, 17), (17,), (64, 300))):
    g = torch.Generator().manual_seed(seed)
    a = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    return a, b


def grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) * scale for p in params]


def set_grads(params, step):
    for p, g in zip(params, grads(params, step)):
        p.grad = g


def test_thirty_steps_with_two_groups_and_a_scheduler_match_torch_adamw():
    a, b = twins()
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0,
                                                                   "lr": 5e-3}]
    ours = FusedAdamW(groups(a), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW(groups(b), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    s1 = torch.optim.lr_scheduler.LambdaLR(ours, lambda k: 1.0 / (1 + k))
    s2 = torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 1.0 / (1 + k))
    for step in range(30):
        for p, q, g in zip(a, b, grads(a, step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        s1.step()
        s2.step()
    drift = max(((p - q).abs() / (1 + q.abs())).max().item() for p, q in zip(a, b))
    print(f"max drift {drift:.2e} (bound 4e-7)")
    for p, q in zip(a, b):
        assert close(q, p)
    assert ours.state[a[0]]["step"].item() == 30
    for key in ("exp_avg", "exp_avg_sq"):
        for p, q in zip(a, b):
            assert close(ref.state[q][key], ours.state[p][key], 1e-6)


def test_the_bf16_shadow_is_the_round_to_nearest_even_of_each_new_weight():
    a, _ = twins()
    opt = FusedAdamW(a, lr=1e-2, shadow_dtype=torch.bfloat16)
    assert opt.shadow(a[0]) is None
    for step in range(3):
        set_grads(a, step)
        opt.step()
        for p in a:
            assert torch.equal(opt.shadow(p), p.detach().to(torch.bfloat16))


def test_loss_scale_and_clipping_are_folded_in_as_unscale_then_clip_grad_norm_then_adamw():
    a, b = twins()
    ours = FusedAdamW(a, lr=1e-2, max_grad_norm=0.5)
    ref = torch.optim.AdamW(b, lr=1e-2)
    scale = 1024.0
    for step in range(10):
        gs = grads(a, step, scale=3.0)
        for p, q, g in zip(a, b, gs):
            p.grad = g * scale          # what backward leaves under a loss scale
            q.grad = g.clone()          # unscaled by hand for the reference
        ours.step(loss_scale=scale)
        norm = torch.nn.utils.clip_grad_norm_(b, 0.5)
        ref.step()
        assert ours.last_grad_norm == pytest.approx(norm.item(), rel=1e-5)
    for p, q in zip(a, b):
        assert close(q, p, 1e-6)


def test_an_inf_gradient_skips_the_step_and_touches_nothing():
    a, _ = twins()
    opt = FusedAdamW(a, lr=1e-2, max_grad_norm=1.0)
    set_grads(a, 0)
    opt.step()
    before = [p.detach().clone() for p in a]
    a[1].grad[3] = float("inf")
    opt.step()
    assert opt.last_step_skipped and math.isinf(opt.last_grad_norm)
    assert all(torch.equal(p, q) for p, q in zip(a, before))
    assert opt.state[a[0]]["step"].item() == 1


def test_state_dicts_move_between_fusedadamw_and_torch_adamw():
    a, b = twins()
    ours = FusedAdamW(a, lr=1e-2)
    for step in range(3):
        set_grads(a, step)
        ours.step()
    ref = torch.optim.AdamW(b, lr=1e-2)
    for p, q in zip(a, b):
        q.data.copy_(p.data)
    # (deep copies: load_state_dict keeps the very tensors it is given when their dtype fits)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    back_params = [torch.nn.Parameter(p.detach().clone()) for p in a]
    back = FusedAdamW(back_params, lr=1e-2)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))  # and torch's state back into FusedAdamW
    for step in range(3, 6):
        gs = grads(a, step)
        for p, q, r, g in zip(a, b, back_params, gs):
            p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()
        ours.step()
        ref.step()
        back.step()
    for p, q, r in zip(a, b, back_params):
        assert close(q, p)
        assert torch.equal(p, r)


def test_fsdp2_with_cpu_offload_trains_on_fusedadamw_as_on_torch_adamw(tmp_path):
    out = run_fsdp2(tmp_path, world=1, clip=0.0)
    for x, y in zip(out["torch"]["params"], out["spillway"]["params"]):
        assert close(torch.tensor(x), torch.tensor(y), 1e-6)
    assert out["spillway"]["losses"] == pytest.approx(out["torch"]["losses"], rel=1e-5)


@pytest.mark.parametrize("make, says", [
    (lambda: FusedAdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))]), "is on meta"),
    (lambda: FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))]), "float16"),
    (lambda: FusedAdamW([torch.nn.Parameter(torch.zeros(4, 4).t())]), "not contiguous"),
    (lambda: FusedAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "amsgrad": True}]), "amsgrad"),
    (lambda: FusedAdamW([torch.nn.Parameter(torch.zeros(3))], lr=-1), "lr = -1"),
    (lambda: FusedAdamW([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0)), "betas"),
    (lambda: FusedAdamW([torch.nn.Parameter(torch.zeros(3))], shadow_dtype=torch.float64), "shadow_dtype"),
])
def test_bad_input_is_refused_by_name(make, says):
    with pytest.raises(ValueError, match=says):
        make()


def test_bad_input_a_state_dict_of_another_model_is_refused_by_shape_and_nothing_changes():
    a, _ = twins()
    opt = FusedAdamW(a, lr=1e-2)
    set_grads(a, 0)
    opt.step()
    other, _ = twins(shapes=((17, 300), (17,), (64, 300)))
    wrong = FusedAdamW(other, lr=1e-2)
    set_grads(other, 0)
    wrong.step()
    opt.load_state_dict(wrong.state_dict())  # torch checks group sizes only
    before = [p.detach().clone() for p in a]
    set_grads(a, 1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.params\[0\] \(300, 17\): state\['exp_avg'\] has "
                                          r"shape \(17, 300\)"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a, before))


def test_bad_input_a_step_count_or_scale_spillway_refuses_reaches_python_as_an_error():
    k = spillway._spillway.AdamKernel(1)
    z = lambda: torch.zeros(8)
    with pytest.raises(spillway.InvalidArgument, match="step 0"):
        k.update("t", z(), z(), z(), z(), None, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0)
    with pytest.raises(spillway.InvalidArgument, match="exp_avg has 4 elements"):
        k.update("t", z(), torch.zeros(4), z(), z(), None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0)


def test_the_shadow_stays_16_bit_across_a_state_dict_round_trip():
    a, _ = twins()
    opt = FusedAdamW(a, lr=1e-2, shadow_dtype=torch.bfloat16)
    set_grads(a, 0)
    opt.step()
    again = FusedAdamW(a, lr=1e-2, shadow_dtype=torch.bfloat16)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in a:
        assert again.shadow(p).dtype == torch.bfloat16
        assert torch.equal(again.shadow(p), p.detach().to(torch.bfloat16))


def test_bad_input_a_bad_state_on_a_later_parameter_changes_no_parameter():
    a, _ = twins()
    opt = FusedAdamW(a, lr=1e-2)
    set_grads(a, 0)
    opt.step()
    opt.state[a[2]]["exp_avg"] = torch.zeros(3)  # the last parameter's state is wrong
    before = [p.detach().clone() for p in a]
    steps = [opt.state[p]["step"].item() for p in a]
    with pytest.raises(ValueError, match=r"params\[2\] \(64, 300\): state\[.exp_avg.\]"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a, before))
    assert [opt.state[p]["step"].item() for p in a] == steps


FSDP2 = """
import json, os, sys, torch, torch.distributed as dist
import spillway
from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy
from torch.distributed.device_mesh import init_device_mesh
clip = float(sys.argv[1])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
out = {}
for which in ("torch", "spillway"):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    if which == "spillway":
        opt = spillway.optim.FusedAdamW(m.parameters(), lr=1e-2, max_grad_norm=clip)
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + dist.get_rank())   # each rank its own batch
    losses = []
    for _ in range(6):
        loss = m(torch.randn(16, 32, generator=g)).square().mean()
        loss.backward()
        if which == "torch" and clip > 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step(); opt.zero_grad()
        losses.append(loss.item())
    out[which] = {"losses": losses, "params": [p.to_local().detach().clone().tolist() for p in m.parameters()]}
if dist.get_rank() == 0:
    print(json.dumps(out))
dist.destroy_process_group()
# Out without the interpreter's finalization. The model and the mesh keep the Gloo group alive past
# destroy_process_group, and its worker thread can still be destroying the last all-reduce's work
# (whose tensor Python already dropped) when finalization starts: the decref takes the GIL, CPython
# ends a thread that takes the GIL during finalization with pthread_exit, and the forced unwind
# through a noexcept destructor is std::terminate ("terminate called without an active
# exception", about 1 run in 25 under load; core backtrace: ProcessGroupGloo::runLoop ->
# ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def run_fsdp2(tmp_path, world, clip):
    """FSDP2 with CPUOffloadPolicy on a Gloo group of `world` processes, trained once on
    torch.optim.AdamW (+ clip_grad_norm_ when clip > 0) and once on FusedAdamW(max_grad_norm=clip)."""
    import json
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2)
    procs = [subprocess.Popen([sys.executable, str(script), str(clip)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(world)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-1500:] + e[-3000:] for o, e in outs)
    return json.loads(outs[0][0].strip().splitlines()[-1])


def test_fsdp2_on_two_ranks_clips_by_the_global_norm_as_clip_grad_norm_does(tmp_path):
    out = run_fsdp2(tmp_path, world=2, clip=0.05)
    for x, y in zip(out["torch"]["params"], out["spillway"]["params"]):
        assert close(torch.tensor(x), torch.tensor(y), 1e-5)
