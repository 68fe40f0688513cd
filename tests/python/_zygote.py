"""Worker processes started from a warm interpreter, for the tests that judge what a worker computes,
raises or writes, not the memory its process holds: a zygote imports torch, DeepSpeed (on the
accelerator the tests use), torch._dynamo (which DeepSpeed's initialize imports) and transformers
once, then forks one child per worker, which runs it as `python script.py ARGS`, `python -c CODE
ARGS` or `python -m MODULE ARGS` would, in its own process with its own environment, working
directory and standard streams. Each DeepSpeed worker otherwise spends 5-6 s of a 10 s run
importing those (docs/ci.md).

    from _zygote import run, popen
    p = run([sys.executable, WORKER, ...], capture_output=True, text=True, timeout=600, env=env)

`run` and `popen` take subprocess.run's and Popen's arguments and return what they return
(CompletedProcess; a Popen-like object with pid, stdout, stderr, returncode, poll, wait,
communicate, send_signal, kill). A command the zygote cannot start as `python script.py` would
start itself runs as a plain subprocess instead: a program other than this interpreter, other
interpreter options, an environment whose import-time settings differ from the zygote's (the OpenMP and MKL thread counts,
LD_PRELOAD, the PYTHON* variables, ...: such a command gets a zygote of its own), DeepSpeed's CUDA
accelerator, and every command under SPILLWAY_TEST_ZYGOTE=0. So does
`fresh=True`, which a test passes when it measures the process's memory: a forked child shares the
zygote's pages, so its RSS and PSS are not a fresh process's.

What differs from an exec'd process, besides the shared pages: the preloaded modules are imported
before the script's first line (in the zygote's environment, which must match on the variables
above), and their import-time output was printed once, by the zygote. The zygote holds no thread
when it forks but the idle one `import torch` starts, after which torch is made to be forked (every
fork-context DataLoader worker is): a zygote whose imports start another refuses to serve, and
every command runs as a subprocess. A child exits through the interpreter's normal shutdown (atexit, threads
joined, C++ static destructors), with the exit status `python script.py` would have; the zygote
reaps it and reports that status. The zygote exits when the test process that started it does
(its stdin closes)."""
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading

PRELOAD = ("torch", "deepspeed", "torch._dynamo", "transformers")
# Read by what the zygote imports, at import time: a command whose environment differs on one of
# these runs in a zygote of its own (one per distinct setting) rather than see the first one's.
# Every PYTHON* variable but PYTHONPATH (read at interpreter start) is one of them too.
IMPORT_TIME_ENV = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH",
                   "CUDA_VISIBLE_DEVICES", "TORCH_EXTENSIONS_DIR", "SPILLWAY_TEST_CPUINFO_CACHE",
                   "TRANSFORMERS_VERBOSITY", "HF_HUB_OFFLINE")


def _import_time_key(env):
    python = sorted((k, v) for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONPATH")
    return tuple(env.get(k) for k in IMPORT_TIME_ENV) + tuple(python)


def _serve(path):
    """The zygote's loop (in the zygote process). Returns only in a forked child, with what it runs."""
    import importlib

    import torch  # noqa: F401

    # `import torch` starts one idle native thread of its own; torch is made to be forked after it
    # (every fork-context DataLoader worker is). Any thread beyond those would be lost in the child
    # with whatever lock it held: then the zygote refuses to serve.
    after_torch = len(os.listdir("/proc/self/task"))
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not installed: the workers that need it fail as they would without the zygote
    threads = len(os.listdir("/proc/self/task"))
    if threads != after_torch or threading.active_count() != 1:
        print(f"not ready: the zygote holds {threads} threads after its imports ({after_torch} after torch's; "
              f"Python threads {[t.name for t in threading.enumerate()]}): a fork would lose them", flush=True)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "parent":  # the test process is gone
                if not os.read(sys.stdin.fileno(), 4096):
                    return None
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                    request = json.loads(message)
                except (OSError, ValueError) as e:
                    conn.close()
                    print(f"zygote: a bad request ({e})", file=sys.stderr, flush=True)
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    conn.close()
                    for pidfd, (_, other) in _children.items():
                        os.close(pidfd)
                        other.close()
                    _children.clear()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                _children[pidfd] = (pid, conn)
                sel.register(pidfd, selectors.EVENT_READ, "child")
                conn.send(json.dumps({"pid": pid}).encode())
            else:
                pidfd = key.fd
                pid, conn = _children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # the test stopped waiting for it
                conn.close()


_children = {}


def _become(request, fds):
    """In the forked child: becomes `python script.py ARGS`, `python -c CODE ARGS` or
    `python -m MODULE ARGS` in the request's environment."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    zygote_path = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    if argv[1] == "-c":
        first = ""
    elif argv[1] == "-m":
        first = os.getcwd()
    else:
        first = os.path.dirname(os.path.abspath(argv[1]))
    # sys.path as a fresh interpreter would have it: the script's folder (-c: '', -m: the working
    # directory), then PYTHONPATH, then the rest.
    ours = {p for p in zygote_path.split(os.pathsep) if p} | {os.path.dirname(os.path.abspath(__file__))}
    rest = [p for p in sys.path[1:] if p not in ours]
    sys.path[:] = [first] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + rest
    import types
    from importlib.machinery import BuiltinImporter, SourceFileLoader

    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    main.__spec__ = None
    main.__cached__ = None
    sys.modules["__main__"] = main
    # An exception or SystemExit below leaves the process as it would leave `python ...`.
    if argv[1] == "-m":
        import runpy

        sys.argv = ["-m"] + argv[3:]
        runpy._run_module_as_main(argv[2], alter_argv=True)
    elif argv[1] == "-c":
        sys.argv = ["-c"] + argv[3:]
        main.__loader__ = BuiltinImporter
        exec(compile(argv[2], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = argv[1:]
        main.__file__ = argv[1]
        main.__loader__ = SourceFileLoader("__main__", argv[1])
        with open(argv[1], "rb") as f:
            code = compile(f.read(), argv[1], "exec")
        exec(code, main.__dict__)


class _Zygote:
    def __init__(self, env):
        self.dir = tempfile.mkdtemp(prefix="spillway-zygote-")
        self.path = os.path.join(self.dir, "sock")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        line = "?"
        while line and line not in ("ready", "") and not line.startswith("not ready:"):
            line = self.proc.stdout.readline()  # past what the imports printed
            line = line.strip() if line else ""
        self.ready = line == "ready"
        self.why = None if self.ready else (line or f"the zygote exited {self.proc.wait()}")

    def start(self, argv, env, cwd, stdin, stdout, stderr):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.path)
        request = {"argv": list(map(str, argv)), "env": env, "cwd": os.fspath(cwd or os.getcwd())}
        socket.send_fds(conn, [json.dumps(request).encode()], [stdin, stdout, stderr])
        pid = json.loads(conn.recv(1 << 16))["pid"]
        return pid, conn


_zygotes = {}
_lock = threading.Lock()


def _zygote_for(argv, env):
    """The zygote that can start `argv` in `env`, or None (then it runs as a subprocess)."""
    if os.environ.get("SPILLWAY_TEST_ZYGOTE", "1") == "0":
        return None
    if env.get("DS_ACCELERATOR", "cpu") != "cpu":
        return None  # DeepSpeed's CUDA accelerator: no fork after CUDA may have been touched
    argv = list(map(str, argv))
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] in ("-c", "-m") and len(argv) < 3 or argv[1].startswith("-") and argv[1] not in ("-c", "-m"):
        return None
    key = _import_time_key(env)
    with _lock:
        if key not in _zygotes:
            zenv = {k: v for k, v in os.environ.items() if not (k in IMPORT_TIME_ENV or k.startswith("PYTHON"))}
            zenv.update({k: v for k, v in env.items() if k in IMPORT_TIME_ENV or k.startswith("PYTHON")})
            _zygotes[key] = _Zygote(zenv)
        z = _zygotes[key]
    return z if z.ready else None


class Process:
    """A zygote's child, as far as the tests use subprocess.Popen."""

    def __init__(self, zygote, argv, env, cwd, stdout, stderr, text):
        self.args = argv
        self.returncode = None
        self._readers, self._out = [], [None, None]
        fds, parent_ends, owned = [], [], []
        null = os.open(os.devnull, os.O_RDWR)
        owned.append(null)
        fds.append(null)
        for want in (stdout, stderr):
            if want == subprocess.PIPE:
                r, w = os.pipe()
                fds.append(w)
                owned.append(w)
                parent_ends.append(open(r, "r" if text else "rb", **({"errors": "replace"} if text else {})))
            elif want == subprocess.STDOUT:
                fds.append(fds[1])
                parent_ends.append(None)
            elif want == subprocess.DEVNULL:
                fds.append(null)
                parent_ends.append(None)
            elif want is None:  # inherited: the caller's own stdout or stderr
                fds.append(len(fds))
                parent_ends.append(None)
            else:  # a file object or a descriptor of the caller's
                fds.append(want if isinstance(want, int) else want.fileno())
                parent_ends.append(None)
        self.stdout, self.stderr = parent_ends
        try:
            self.pid, self._conn = zygote.start(argv, env, cwd, *fds)
        finally:
            for fd in owned:
                os.close(fd)

    def _finish(self, message):
        if not message:
            raise RuntimeError(f"the zygote stopped before it reported pid {self.pid}'s exit")
        self.returncode = json.loads(message)["returncode"]
        self._conn.close()

    def poll(self):
        if self.returncode is None:
            sel = selectors.DefaultSelector()
            sel.register(self._conn, selectors.EVENT_READ)
            ready = sel.select(0)
            sel.close()
            if ready:
                self._finish(self._conn.recv(1 << 16))
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                message = self._conn.recv(1 << 16)
            except (socket.timeout, TimeoutError):
                self._conn.settimeout(None)
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._finish(message)
        return self.returncode

    def communicate(self, timeout=None):
        if not self._readers:
            for i, stream in enumerate((self.stdout, self.stderr)):
                if stream is not None:
                    t = threading.Thread(target=lambda i=i, s=stream: self._out.__setitem__(i, s.read()), daemon=True)
                    t.start()
                    self._readers.append(t)
        self.wait(timeout)
        for t in self._readers:
            t.join()
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return tuple(self._out)

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def popen(argv, *, env=None, cwd=None, stdout=None, stderr=None, text=False, fresh=False, **kwargs):
    env = dict(os.environ if env is None else env)
    zygote = None if fresh or kwargs else _zygote_for(argv, env)
    if zygote is None:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text, **kwargs)
    return Process(zygote, list(map(str, argv)), env, cwd, stdout, stderr, text)


def run(argv, *, capture_output=False, timeout=None, check=False, env=None, cwd=None, text=False, stdout=None,
        stderr=None, fresh=False, **kwargs):
    if kwargs:  # what only subprocess takes (input=, stdin=, ...)
        return subprocess.run(argv, capture_output=capture_output, timeout=timeout, check=check, env=env, cwd=cwd,
                              text=text, stdout=stdout, stderr=stderr, **kwargs)
    if capture_output:
        stdout = stderr = subprocess.PIPE
    p = popen(argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text, fresh=fresh)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    if check and p.returncode:
        raise subprocess.CalledProcessError(p.returncode, argv, out, err)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


if __name__ == "__main__":
    served = _serve(sys.argv[1])
    if served is not None:
        _become(*served)
