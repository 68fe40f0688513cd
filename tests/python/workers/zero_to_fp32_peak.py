"""One conversion of a ZeRO checkpoint to consolidated weights, its peak host memory measured:

    python zero_to_fp32_peak.py spillway|deepspeed CHECKPOINT_DIR OUTPUT_DIR

spillway: spillway.zero_to_fp32.convert (safetensors); deepspeed: DeepSpeed's own
convert_zero_checkpoint_to_fp32_state_dict (its default format, pytorch_model.bin: its safetensors
output fails on tied weights). Both libraries are imported first; the peak is VmHWM after
`echo 5 > /proc/self/clear_refs` less VmRSS before, printed as JSON {"peak": bytes}."""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict  # noqa: E402

from spillway import zero_to_fp32  # noqa: E402

which, ckpt, out = sys.argv[1:4]


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
if which == "spillway":
    zero_to_fp32.convert(ckpt, out)
elif which == "deepspeed":
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, out)
else:
    sys.exit(f"unknown converter {which!r}: spillway or deepspeed")
print(json.dumps({"peak": status("VmHWM") - before}))
