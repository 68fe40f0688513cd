"""One rank of spillway.engine.train_gpt on a torch.distributed Gloo group (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT from the environment, as torchrun sets them).

    python engine_rank.py CONFIG_JSON STEPS MICRO_BATCHES OUT_FILE

Rank 0 saves the result dict (losses, params, backend, ...) to OUT_FILE with torch.save.
"""
import json
import sys

import torch
import torch.distributed as dist

import spillway

config, steps, micro, out = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
try:
    result = spillway.engine.train_gpt(config, steps=steps, micro_batches=micro, group=dist.group.WORLD)
    if dist.get_rank() == 0:
        torch.save(result, out)
finally:
    dist.destroy_process_group()
