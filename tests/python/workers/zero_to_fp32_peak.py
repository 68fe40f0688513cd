"""One conversion of a ZeRO checkpoint to consolidated weights, its peak host memory measured:

    python zero_to_fp32_peak.py spillway|deepspeed CHECKPOINT_DIR OUTPUT_DIR

spillway: spillway.zero_to_fp32.convert (safetensors); deepspeed: DeepSpeed's own
convert_zero_checkpoint_to_fp32_state_dict (its default format, pytorch_model.bin: its safetensors
output fails on tied weights). Both libraries are imported first; the peak is _peak.peak's, printed
as JSON {"peak": bytes}."""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict  # noqa: E402

from _peak import peak  # noqa: E402
from spillway import zero_to_fp32  # noqa: E402

which, ckpt, out = sys.argv[1:4]


if which == "spillway":
    convert = zero_to_fp32.convert
elif which == "deepspeed":
    convert = convert_zero_checkpoint_to_fp32_state_dict
else:
    sys.exit(f"unknown converter {which!r}: spillway or deepspeed")
print(json.dumps({"peak": peak(lambda: convert(ckpt, out))[0]}))
