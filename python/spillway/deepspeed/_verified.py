"""What Spillway was verified against in DeepSpeed, in one place: the bodies of the DeepSpeed
functions a part of install() takes over or relies on, each by a digest of its parsed source (so
comments and formatting do not count) with the DeepSpeed releases it was read from. A part whose
functions here have bodies not listed stays DeepSpeed's, and its warning names the function; a
release is tested (TESTED_DEEPSPEED) when its bodies are in the table. Private: _step checks the
fused step's functions against the table, install() names a release outside TESTED_DEEPSPEED, and
_save refuses a multi-rank gather outside the releases it was verified on.
"""
import ast
import functools
import hashlib
import inspect
import sys


def _canon(node):
    """A parsed function as nested tuples: what it does, without comments, formatting, line numbers
    or the fields newer Pythons add (type_params), so it reads the same on Python 3.11 to 3.13."""
    if isinstance(node, ast.AST):
        return (type(node).__name__,) + tuple((f, _canon(getattr(node, f, None))) for f in node._fields
                                              if f not in ("ctx", "type_params", "type_comment"))
    if isinstance(node, list):
        return tuple(_canon(x) for x in node)
    return node


@functools.lru_cache(maxsize=None)
def _methods(cls):
    """{name: FunctionDef} of `cls` as its module's source defines it (decorators such as
    DeepSpeed's instrument_w_nvtx wrap the function objects, so their source is the wrapper's).
    Parsed once per class: both ZeRO stages' checks read DeepSpeedCPUAdam's."""
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__), [])
    return {n.name: n for n in body if isinstance(n, ast.FunctionDef)}


def _digest(fn_def):
    return hashlib.sha256(repr(_canon(fn_def)).encode()).hexdigest()[:16]


def _self_calls_in_order(fn_def):
    """Names of the self.<method>(...) calls in a function, in source order."""
    calls = [(n.lineno, n.col_offset, n.func.attr) for n in ast.walk(fn_def)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    return [name for *_pos, name in sorted(calls)]


# The bodies of the functions the fused step takes over or relies on (the seam, the step() that
# calls it, the unflatten after the copy, DeepSpeedCPUAdam.step whose state the fused pass keeps),
# by digest (_digest), each with the DeepSpeed releases it was read from. Only releases whose
# DeepSpeed tests passed with Spillway (scripts/check-deepspeed) are listed. A DeepSpeed whose
# function has a body not listed keeps its own step, and the warning names the function.
_VERIFIED = {
    ("stage3", "step"): {"ae01fb5618f6b919": ("0.17.6", "0.18.9", "0.19.0"), "00d1fe6b08243b55": ("0.19.8",)},
    ("stage3", "unscale_and_clip_grads"): {"c4af4106f8679711": ("0.17.6", "0.18.9", "0.19.0", "0.19.8")},
    ("stage3", "_optimizer_step"): {"6041066ad0436827": ("0.17.6",), "fec36c701e7cb1d4": ("0.18.9", "0.19.0"),
                                    "b0a26eeea1220065": ("0.19.8",)},
    ("stage3", "_reassign_or_swap_out_partitioned_parameters"): {
        "48dfa46d6404120b": ("0.17.6", "0.18.9", "0.19.0", "0.19.8")},
    ("stage3", "_unflatten_partitioned_parameters"): {
        "275d05ec57ccc2f5": ("0.17.6", "0.18.9", "0.19.0", "0.19.8")},
    ("zero12", "step"): {"75e6c1a6bdacb78f": ("0.17.6", "0.18.9", "0.19.0"), "0782f13f7b53f729": ("0.19.8",)},
    ("zero12", "unscale_and_clip_grads"): {"7aa98b514b82854b": ("0.17.6", "0.18.9", "0.19.0"),
                                           "d68eece851406849": ("0.19.8",)},
    ("zero12", "_optimizer_step"): {"e930383659fcfbc3": ("0.17.6", "0.18.9", "0.19.0", "0.19.8")},
    ("cpu_adam", "step"): {"7a71556d98c79bef": ("0.17.6", "0.18.9", "0.19.0", "0.19.8")},
}
# Read but not yet verified (scripts/check-deepspeed not yet run to its end on them): 0.18.0 has
# 0.17.6's bodies throughout; 0.19.4 and 0.19.7 differ in ZeRO-1/2's step (and 0.19.7 in its
# unscale_and_clip_grads); 0.16.9 in three. Add a release only after its check passes.


def _release(version):
    return [int(x) for x in version.split(".")]


# The DeepSpeed releases whose runs are tested: 0.19.8 by CI (tests/python), the others by
# scripts/check-deepspeed (docs/deepspeed.md, "Versions"; on the CPU accelerator): the releases the
# verified bodies were read from, which only a release whose check passed is added to. install()
# names a DeepSpeed outside them.
TESTED_DEEPSPEED = tuple(sorted({v for bodies in _VERIFIED.values() for vs in bodies.values() for v in vs},
                                key=_release))

# The tested releases on which the weights two ranks gather one parameter at a time were checked
# against DeepSpeed's own engine.save_16bit_model (test_deepspeed_save.py, under scripts/check-deepspeed
# for releases other than the installed one). On 0.18.9 (CPU accelerator, Gloo) some gathered
# parameters held wrong values (zeros, 1e38): with several ranks the save is refused there, before
# any collective, so every rank refuses alike. Not yet found why, so no function body can stand for
# it: these are releases, not digests, until the function whose body differs is found.
_GATHER_VERIFIED = ("0.19.8",)


def _unverified(key, owner, defs, names, what):
    """None when `defs` ({name: FunctionDef} of `owner`, from _methods) has each of `names` with a
    body listed under `key`; else what differs, naming the function, for `what`'s warning."""
    missing = [n for n in names if n not in defs]
    if missing:
        return f"its {owner.__name__} lacks {', '.join(missing)}"
    for name in names:
        digest = _digest(defs[name])
        if digest not in _VERIFIED[(key, name)]:
            return (f"its {owner.__name__}.{name} is not one {what} was verified against "
                    f"(body {digest}; verified: DeepSpeed {_verified_range(key, name)})")
    return None


def _verified_range(which, name):
    versions = sorted({v for vs in _VERIFIED[(which, name)].values() for v in vs}, key=_release)
    return ", ".join(versions) if versions else "none"
