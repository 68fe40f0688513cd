"""The live Prometheus exporter: `spillway.metrics.serve("127.0.0.1:9464", arenas)`."""
from . import _spillway


def serve(address="127.0.0.1:9464", arenas=()):
    """Starts serving /metrics on `address` ("host:0" picks a free port; `.port` says which) and
    watches each arena (its live bytes by kind and lifetime, escapes, pinned bytes). Serving stops
    when the returned exporter is garbage-collected. Raises spillway.Unavailable when the port is
    taken."""
    exporter = _spillway._serve(address)
    for a in arenas:
        exporter.watch(a)
    return exporter
