# The spillway package is built into <build>/python; ctest puts it on PYTHONPATH.
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: no GPU here
