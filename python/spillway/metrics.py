"""The live Prometheus exporter: `spillway.metrics.serve("127.0.0.1:9464")`."""
import os

from . import _metrics_registry, _spillway, _torch_allocators
from .deepspeed import _swap as _deepspeed_swap


def _rank():
    try:
        import torch.distributed as dist  # noqa: PLC0415

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:  # noqa: BLE001 (no process group is not an error here)
        pass
    return os.environ.get("RANK")


def serve(address="127.0.0.1:9464", arenas=None, rank=None):
    """Starts serving /metrics on `address` ("host:0" picks a free port; `.port` says which).

    Watches `arenas`; by default the arenas of spillway.install() (DeepSpeed's host bytes by kind:
    param, grad, master_weight, optimizer_state, swap_buffer), with their ledger's epoch and step.
    Every sample carries `rank` (default: torch.distributed's rank, else $RANK) as a label, so the
    ranks of one job can be summed or told apart. When the process joined a node budget
    (spillway.node), the node's ledger is served too: spillway_node_* (the same series from every
    rank's exporter, labelled by local_rank where they are per rank). Serving stops when the returned exporter is
    garbage-collected. Raises spillway.Unavailable when the port is taken."""
    if arenas is None:
        runtime = _torch_allocators.installed()
        arenas = runtime.arenas if runtime is not None else ()
    rank = _rank() if rank is None else str(rank)
    exporter = _spillway._serve(address, {"rank": rank} if rank is not None else {})
    for a in arenas:
        exporter.watch(a)
    exporter._watch_node()  # the node's ledger, when this process joined one (spillway.node)
    # DeepSpeed's NVMe swap stores: those made already, and those made later (_metrics_registry).
    _metrics_registry.add_exporter(exporter, _deepspeed_swap.stores)
    return exporter
