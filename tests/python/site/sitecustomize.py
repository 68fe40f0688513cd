"""Loaded by every Python process of the test suite (ctest puts this folder on PYTHONPATH for the
`python` label): a machine-wide cache of py-cpuinfo's answer, which DeepSpeed asks for every time it
loads one of its JIT ops (the -march and SIMD flags of a CPU op), when SPILLWAY_TEST_CPUINFO_CACHE
names a folder. py-cpuinfo answers from a subprocess that times the CPU's clock, 1.2 s a call and
three calls for every DeepSpeed engine the tests make: about 3.7 s of each of some 150 DeepSpeed
processes. The first process on the machine asks py-cpuinfo itself and keeps its answer; every
later one reads it. The answer is the real one; only the clock measured in it (hz_actual, which
DeepSpeed does not read) is the first process's. Then any other sitecustomize on the path runs, as
it would have without this one. docs/ci.md."""
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _machine_key():
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith((b"model name", b"flags", b"vendor_id"))]
    except OSError:
        return None
    return hashlib.sha256(b"\n".join(sorted(set(lines))) + sys.version.encode()).hexdigest()[:16]


def _cache_cpuinfo(folder):
    try:
        import cpuinfo
    except ImportError:
        return  # DeepSpeed then reads lscpu: nothing to cache
    key = _machine_key()
    if key is None:
        return
    path = os.path.join(folder, f"cpuinfo-{getattr(cpuinfo, 'CPUINFO_VERSION_STRING', '?')}-{key}.json")
    real = cpuinfo.get_cpu_info

    def get_cpu_info():
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
        info = real()
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)
        return info

    cpuinfo.get_cpu_info = get_cpu_info


def _chain():
    """The sitecustomize this one shadows (a distribution's), if any, runs as it would have."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("SPILLWAY_TEST_CPUINFO_CACHE"):
    _cache_cpuinfo(os.environ["SPILLWAY_TEST_CPUINFO_CACHE"])
_chain()
