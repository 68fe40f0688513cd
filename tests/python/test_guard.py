"""spillway.guard: the device mix-ups of the seed reports, each reproduced with its control: torch's
bare error (or silence) without the guard, Spillway's named error with it. On this machine without a
GPU the "other device" is meta; scripts/gpu-check runs the same file with cuda where one is lent."""
import os
import subprocess
import sys
import textwrap

import _zygote
import pytest
import torch

import spillway
from spillway import guard

OTHER = "cuda" if torch.cuda.is_available() else "meta"


def test_a_delta_on_another_device_added_to_a_weight_is_named_easyedit_memit():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    delta = torch.randn(4, 8, device=OTHER)
    w = model[1].weight
    # Control: torch's own error names no tensor.
    with pytest.raises(RuntimeError) as bare:
        _ = w + delta
    assert "1.weight" not in str(bare.value)
    with pytest.raises(spillway.DeviceMismatch) as named, guard.devices(model):
        _ = w + delta
    text = str(named.value)
    assert "aten.add" in text
    assert "1.weight float32[4x8] on cpu" in text
    assert f"(a temporary: not a parameter, buffer, gradient or optimizer state) float32[4x8] on {OTHER}" in text
    assert "test_guard.py" in text and "_ = w + delta" in text  # the caller's frame
    assert "fix: put them on one device" in text
    assert isinstance(named.value, RuntimeError)  # code that catches torch's error still catches it


def test_an_in_place_add_torch_lets_through_silently_is_refused():  # on meta wherever it runs
    model = torch.nn.Linear(8, 4)
    delta = torch.randn(4, 8, device="meta")
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(delta)  # control: torch raises nothing
    with torch.no_grad(), pytest.raises(spillway.DeviceMismatch, match=r"weight float32\[4x8\] on cpu"), \
            guard.devices(model):
        model.weight.add_(delta)
    del before


def test_optimizer_state_and_gradients_are_named_and_scalars_on_the_cpu_pass():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with guard.devices(model, opt) as mode:
        model.weight.grad.mul_(torch.tensor(0.5))  # a 0-dim CPU tensor: allowed, as in torch
        opt.step()
    assert mode.ops_checked > 0
    buf = opt.state[model.weight]["momentum_buffer"]
    with pytest.raises(spillway.DeviceMismatch) as e, guard.devices(model, opt):
        buf.add_(torch.ones(4, 8, device=OTHER) + 0)
    assert "weight optimizer state['momentum_buffer'] float32[4x8] on cpu" in str(e.value)
    with pytest.raises(spillway.DeviceMismatch, match=r"weight\.grad float32\[4x8\] on cpu"), guard.devices(model):
        model.weight.grad.mul_(torch.tensor(2.0, device=OTHER))
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    assert _get_current_dispatch_mode() is None  # off: no mode stays installed


def test_copies_between_devices_pass():
    with guard.devices():
        x = torch.randn(4).to(OTHER)
        torch.empty(4, device=OTHER).copy_(torch.randn(4))
    assert x.device.type == OTHER


# A one-process Gloo world and the small model both DeepSpeed scripts below train.
WORLD = """with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
deepspeed.init_distributed(dist_backend="nccl" if os.environ["DS_ACCELERATOR"] == "cuda" else "gloo",
                           auto_mpi_discovery=False)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
"""

DS = """
import os, socket, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, deepspeed, spillway
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero12
OTHER = %(other)r
STAGE = int(sys.argv[2])

# DeepSpeed 0.14.1's bug, injected into 0.19.8: the combined scale on the accelerator while the fp32
# gradients of offload_optimizer live on the CPU (seeds 000-002: Axolotl, Qwen3-72B, XTuner Yi-34B).
def unscale_and_clip_grads(self, sub_group_id, total_norm):
    combined_scale = torch.tensor(float(self.loss_scale), device=OTHER)
    self.fp32_partitioned_groups_flat[sub_group_id].grad.mul_(1. / combined_scale)
Stage3.unscale_and_clip_grads = unscale_and_clip_grads
def unscale_and_clip_grads_zero12(self, grad_groups_flat, total_norm):  # the same bug in ZeRO-1/2
    combined_scale = torch.tensor(float(self.loss_scale), device=OTHER)
    grad_groups_flat[0].mul_(1. / combined_scale)
Zero12.unscale_and_clip_grads = unscale_and_clip_grads_zero12
if sys.argv[1] == "guard":
    spillway.deepspeed.install(step=False)
%(world)s
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "bf16": {"enabled": True},
          "zero_optimization": {"stage": STAGE, "offload_optimizer": {"device": "cpu"}}}
if STAGE == 3:
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
print("ENGINE", engine.device, file=sys.stderr, flush=True)
loss = engine(torch.randn(4, 16).to(engine.device, torch.bfloat16)).float().sum()
engine.backward(loss)
engine.step()
"""


def ds_run(mode, stage, accelerator="cpu"):
    script = DS % {"other": OTHER, "world": WORLD}
    p = _zygote.run([sys.executable, "-c", script, mode, str(stage)], capture_output=True, text=True,
                    timeout=900, env={**os.environ, "DS_ACCELERATOR": accelerator})
    return p.returncode, p.stderr


@pytest.mark.parametrize("stage", [3, 2, 1])
def test_deepspeed_0_14_1s_scale_on_another_device_is_named_by_the_guard_install_turns_on(stage):
    pytest.importorskip("deepspeed")
    check_seed_000_is_named(stage, "cpu")


def check_seed_000_is_named(stage, accelerator):
    """DeepSpeed on `accelerator` (cpu: its CPU accelerator; cuda: the model on cuda:0, what users
    run, in test_gpu_deepspeed.py) with the scale injected on OTHER."""
    rc, bare = ds_run("plain", stage, accelerator)
    if OTHER == "cuda":  # the seed: torch's bare error, naming no tensor
        assert rc != 0 and "Expected all tensors to be on the same device" in bare and "DeviceMismatch" not in bare
    else:  # torch lets an in-place mul_ take a 0-dim meta tensor without a word: the step "succeeds"
        assert rc == 0, bare[-3000:]
    rc, named = ds_run("guard", stage, accelerator)
    assert f"ENGINE {'cuda:0' if accelerator == 'cuda' else 'cpu'}" in named, named[-2000:]  # it ran where asked
    assert rc != 0
    assert "spillway.DeviceMismatch: aten.mul_" in named, named[-3000:]
    grad = ("DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat[0].grad" if stage == 3
            else "DeepSpeedZeroOptimizer.single_partition_of_fp32_groups[0].grad")
    assert f"{grad} float32" in named, named[-3000:]
    assert f"float32[scalar] on {OTHER}" in named, named[-3000:]
    assert "in unscale_and_clip_grads" in named  # the injected function: the caller's frame
    assert "a scalar factor that enters host math belongs on the CPU" in named


# A mix-up that appears late, after the steps the default guard checks op by op. "late": at step 5 the
# unscale multiplies by a full tensor on the other device (torch's own error, even with meta). "moved":
# before step 5 the training loop puts a scale tensor on the ZeRO optimizer on the other device, and
# the unscale multiplies by it in place (torch lets a 0-dim meta factor through without a word).
DS_LATE = """
import os, socket, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, deepspeed, spillway
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
OTHER, MODE, GUARD = %(other)r, sys.argv[1], sys.argv[2]
calls = [0]
original = Stage3.unscale_and_clip_grads
def unscale_and_clip_grads(self, sub_group_id, total_norm):
    calls[0] += 1
    grad = self.fp32_partitioned_groups_flat[sub_group_id].grad
    if MODE == "late" and calls[0] == 5:
        grad.copy_(grad * torch.ones(grad.shape, device=OTHER))
    if MODE == "moved" and getattr(self, "extra_scale", None) is not None:
        grad.mul_(1. / self.extra_scale)
    return original(self, sub_group_id, total_norm)
Stage3.unscale_and_clip_grads = unscale_and_clip_grads
if GUARD != "plain":
    spillway.deepspeed.install(step=False, guard=True if GUARD == "default" else GUARD)
%(world)s
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                           "offload_param": {"device": "cpu"}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
if MODE == "badmode":
    engine.optimizer.spillway_guard = "sometimes"
for step in range(1, 9):
    if MODE == "moved" and step == 5:
        engine.optimizer.extra_scale = torch.tensor(1.0, device=OTHER)
    if MODE == "moved" and step == 6:
        engine.optimizer.extra_scale = None
    loss = engine(torch.randn(4, 16).to(torch.bfloat16)).float().sum()
    engine.backward(loss)
    engine.step()
print("guarded steps", getattr(engine.optimizer, "_spillway_guarded_steps", 0), "of", step)
"""


def ds_late(mode, guard_mode):
    script = DS_LATE % {"other": OTHER, "world": WORLD}
    p = _zygote.run([sys.executable, "-c", script, mode, guard_mode], capture_output=True, text=True,
                    timeout=900)
    return p.returncode, p.stdout + p.stderr


def test_the_default_guard_checks_the_first_steps_op_by_op_and_then_none_until_a_tensor_moves():
    pytest.importorskip("deepspeed")
    rc, out = ds_late("none", "default")
    assert rc == 0 and "guarded steps 2 of 8" in out, out[-3000:]
    rc, out = ds_late("none", "always")
    assert rc == 0 and "guarded steps 8 of 8" in out, out[-3000:]
    # A scale tensor put on the optimizer on the other device before step 5: that step is checked op by
    # op and the mix-up is named, where torch itself says nothing (meta) or names no tensor (cuda).
    rc, out = ds_late("moved", "default")
    assert rc != 0 and "spillway.DeviceMismatch: aten.mul_" in out, out[-3000:]
    assert "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat[0].grad float32" in out, out[-3000:]


def test_torchs_device_error_in_an_unchecked_step_becomes_a_device_mismatch_that_says_how_to_name_it():
    pytest.importorskip("deepspeed")
    rc, bare = ds_late("late", "plain")  # the control: torch's error, naming no tensor
    assert rc != 0 and "DeviceMismatch" not in bare and (
        "Expected all tensors to be on the same device" in bare or "is not on the expected device" in bare), bare[-3000:]
    rc, out = ds_late("late", "default")
    assert rc != 0 and "spillway.DeviceMismatch: DeepSpeedZeroOptimizer_Stage3.step() at step 5" in out, out[-3000:]
    assert "install(guard='always')" in out, out[-3000:]
    rc, out = ds_late("late", "always")  # op by op: the op and its tensors named
    assert rc != 0 and "spillway.DeviceMismatch: aten.mul" in out, out[-3000:]
    assert "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat[0].grad float32" in out, out[-3000:]


def test_bad_input_an_unknown_guard_mode_is_refused_naming_the_choices():
    pytest.importorskip("deepspeed")
    p = _zygote.run([sys.executable, "-c", "import spillway.deepspeed as d; d.install(guard='sometimes')"],
                    capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "install(guard='sometimes')" in p.stderr and "'always'" in p.stderr, p.stderr[-2000:]
    rc, out = ds_late("badmode", "default")  # the same mode set on one optimizer, refused at its step
    assert rc != 0 and "DeepSpeedZeroOptimizer_Stage3.spillway_guard = 'sometimes': True" in out, out[-3000:]


def spread_gpt2():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/install-deps)")
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)  # from a config: nothing is downloaded
    # What device_map='auto' leaves: each top-level block on its device, and the map on the model.
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h.0": "cpu",
                  "transformer.h.1": "cpu", "transformer.h.2": OTHER, "transformer.h.3": OTHER,
                  "transformer.ln_f": OTHER, "lm_head": "cpu"}
    for name, device in device_map.items():
        model.get_submodule(name).to(device)
    model.hf_device_map = device_map
    return model


def test_a_model_spread_by_device_map_is_refused_with_its_layers_named():
    model = spread_gpt2()
    with pytest.raises(spillway.DeviceMismatch) as e:
        guard.audit(model)
    text = str(e.value)
    assert "GPT2LMHeadModel is spread over 2 devices" in text
    assert f"device_map {OTHER}: transformer.h.2, transformer.h.3, transformer.ln_f" in text
    assert "transformer.h.0" in text and "device_map=None" in text and "ZeRO-3 or FSDP" in text
    # Control: the same model on one device passes.
    transformers = pytest.importorskip("transformers")
    one = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=128,
                                                               n_positions=64))
    assert guard.audit(one) == "cpu"


def test_the_audit_counts_devices_not_their_spellings():
    # accelerate writes a CUDA device as its index, users write "cuda" or "cuda:0", a parameter there
    # says cuda:0: one device. Seen on a GPU: the spread GPT-2 (cpu and "cuda") was said to span 3.
    assert guard._device_key(0) == guard._device_key("cuda:0") == guard._device_key(torch.device("cuda", 0)) == "cuda:0"
    assert guard._device_key(1) == "cuda:1" and guard._device_key("cpu") == guard._device_key(torch.device("cpu")) == "cpu"
    assert guard._device_key("disk") == "disk"
    if not torch.cuda.is_available():
        assert guard._device_key("cuda") == "cuda:0"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model.hf_device_map = {"0": 0, "1": "cuda:0"}  # one GPU, two spellings
    assert guard.audit(model, parameters=False) == "cpu"
    model.hf_device_map = {"": "meta"}  # a stale one-device map on a model moved whole: one device each
    assert guard.audit(model) == "cpu"
    model.hf_device_map = {"0": 0, "1": "cuda:1"}  # two GPUs: refused, both named as the map has them
    with pytest.raises(spillway.DeviceMismatch) as e:
        guard.audit(model, parameters=False)
    assert "spread over 2 devices" in str(e.value) and "device_map 0: 0" in str(e.value)


def test_deepspeed_initialize_refuses_a_spread_model_after_install():
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers", reason="transformers is not installed (scripts/install-deps)")
    code = textwrap.dedent("""
        import os, sys
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        sys.path.insert(0, %r)
        import deepspeed, spillway
        from test_guard import spread_gpt2
        spillway.deepspeed.install()
        try:
            deepspeed.initialize(model=spread_gpt2(), config={"train_micro_batch_size_per_gpu": 1})
        except spillway.DeviceMismatch as e:
            print("REFUSED", str(e).splitlines()[0])
    """) % str(__import__("pathlib").Path(__file__).parent)
    p = _zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "REFUSED GPT2LMHeadModel is spread over 2 devices" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_ops_torch_runs_across_devices_pass_cpu_indices_and_foreach_lists():
    x = torch.randn(4, 3, device=OTHER)
    idx = torch.tensor([0, 2])
    with guard.devices():
        _ = x[idx]                                     # aten.index with CPU indices
        x[idx] = torch.zeros(2, 3, device=OTHER)       # aten.index_put_
        torch._foreach_mul_([torch.randn(3), torch.randn(3, device=OTHER)], 2.0)  # per element


def test_a_foreach_list_whose_elements_disagree_pairwise_is_named():
    a = [torch.randn(3), torch.randn(3)]
    b = [torch.randn(3), torch.randn(3, device=OTHER)]
    with pytest.raises(spillway.DeviceMismatch, match="aten._foreach_add_"), guard.devices():
        torch._foreach_add_(a, b)


def test_tensors_passed_as_data_are_named_and_the_fix_names_the_in_place_targets_device():
    model = torch.nn.Linear(8, 4)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(spillway.DeviceMismatch) as e, guard.devices(model):
        model.weight.grad.data.add_(torch.randn(4, 8, device=OTHER) * 1)
    text = str(e.value)
    assert "weight.grad float32[4x8] on cpu" in text, text
    assert ".to('cpu')" in text  # in place: the result stays where the gradient is
