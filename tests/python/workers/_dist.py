"""The environment of a one-process torch.distributed world for the workers (a free port on
localhost, rank 0 of 1), unless the caller set up a larger world in the environment."""
import os
import socket


def world_from_env_or_single():
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ["LOCAL_RANK"] = os.environ["RANK"]
