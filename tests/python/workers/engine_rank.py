"""One rank of spillway.engine.train_gpt on a torch.distributed Gloo group (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT from the environment, as torchrun sets them).

    python engine_rank.py CONFIG_JSON STEPS MICRO_BATCHES OUT_FILE [DEVICE [BACKEND [SAVE [RESUME]]]]

DEVICE is the trainer's compute device (default cpu); BACKEND the process group's (default gloo;
"cpu:gloo,cuda:nccl" for collectives on the GPU). Rank 0 saves the result dict (losses, params,
backend, ...) to OUT_FILE with torch.save. SAVE and RESUME are checkpoint directories ("-": none).
"""
import os
import json
import sys

import torch
import torch.distributed as dist

import spillway

config, steps, micro, out = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
backend = sys.argv[6] if len(sys.argv) > 6 else "gloo"
save = sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] != "-" else None
resume = sys.argv[8] if len(sys.argv) > 8 and sys.argv[8] != "-" else None
if device.startswith("cuda"):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(backend)
try:
    result = spillway.engine.train_gpt(config, steps=steps, micro_batches=micro, device=device,
                                       group=dist.group.WORLD, save=save, resume=resume)
    if dist.get_rank() == 0:
        torch.save(result, out)
finally:
    dist.destroy_process_group()
