"""A child memory cgroup of the test process's own, with a limit, for the tests that run ranks under a
memory limit as a container or a Slurm job gives them (tests/python/test_node.py). cgroup v2
(memory.max, memory.events) or v1 (memory.limit_in_bytes, memory.failcnt, memory.oom_control).
Imported by the test files, not collected (no test_ prefix)."""
import os
import time

ROOT = "/sys/fs/cgroup"


class Unavailable(Exception):
    """This machine lets the test make no memory cgroup; the message says why."""


class MemoryCgroup:
    def __init__(self, path, v2):
        self.path, self.v2 = path, v2

    @staticmethod
    def make(name, limit_bytes):
        """A new cgroup `name` under this process's memory cgroup, limited to `limit_bytes`, with
        swap off for it where the kernel lets the limit say so. Raises Unavailable."""
        v1_dir = v2_dir = None
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "" and os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
                    v2_dir = ROOT + path
                elif "memory" in controllers.split(","):
                    v1_dir = os.path.join(ROOT, "memory") + path
        if v2_dir is not None:
            try:
                with open(os.path.join(v2_dir, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        raise Unavailable(f"cgroup v2: the memory controller is not enabled for the children of "
                                          f"{v2_dir}")
            except OSError as e:
                raise Unavailable(f"cgroup v2: {e}") from None
            parent, v2 = v2_dir, True
        elif v1_dir is not None:
            parent, v2 = v1_dir, False
        else:
            raise Unavailable("no memory cgroup (neither v2 nor a v1 memory hierarchy) in /proc/self/cgroup")
        path = os.path.join(parent, name)
        try:
            os.mkdir(path)
        except OSError as e:
            raise Unavailable(f"cannot make a memory cgroup under {parent}: {e}") from None
        cg = MemoryCgroup(path, v2)
        try:
            if v2:
                cg._write("memory.max", limit_bytes)
                cg._write("memory.swap.max", 0, required=False)
            else:
                cg._write("memory.limit_in_bytes", limit_bytes)
                cg._write("memory.memsw.limit_in_bytes", limit_bytes, required=False)
        except BaseException:
            cg.remove()
            raise
        return cg

    def _write(self, name, value, required=True):
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(str(value))
        except OSError as e:
            if required:
                raise Unavailable(f"cannot set {name} of {self.path}: {e}") from None

    def _read(self, name):
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def wrap(self, cmd):
        """`cmd` run inside the cgroup: a shell that moves itself in, then execs it (its children
        are born inside)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.path, *cmd]

    def limit(self):
        return int(self._read("memory.max" if self.v2 else "memory.limit_in_bytes"))

    def oom_kills(self):
        """Processes the cgroup's OOM killer killed."""
        text = self._read("memory.events" if self.v2 else "memory.oom_control")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        raise AssertionError(f"no oom_kill count in {self.path} (a kernel older than 4.13?): {text!r}")

    def peak(self):
        """The cgroup's highest charge (v2: memory.peak, where the kernel has it; else None)."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int(self._read(name))
        except OSError:
            return None

    def remove(self):
        """Removes the cgroup once the processes in it are gone (at most 10 s)."""
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
