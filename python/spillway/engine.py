"""spillway.engine: the old name of spillway.trainer (Spillway's ZeRO-3 reference trainer driven from
Python), kept as an alias: the same train_gpt and DEFAULT_MODEL, and `torchrun -m spillway.engine`
runs the trainer as `-m spillway.trainer` does. New code uses spillway.trainer.
"""
from .trainer import DEFAULT_MODEL, _main, train_gpt  # noqa: F401

if __name__ == "__main__":
    _main()
