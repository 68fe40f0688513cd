"""What spillway.deepspeed's install() and its private modules (_sites, _aio, _step, _swap,
_device_guard, _boundary, _checkpoint, _save, _audit) share: the record of DeepSpeed's functions
patched, which uninstall() restores, _defined and _patch, and DeepSpeed's version. Private: it
imports none of them, so each can import it without a circle.
"""
_patched = []       # (owner, name, original) for each function wrapped


class _Missing(AttributeError):
    """This DeepSpeed lacks a function Spillway patches (a release moved or renamed it)."""


def _defined(owner, name):
    """`owner`'s own `name`: a class's own attribute (its __dict__ entry, not one it inherits) or a
    module's. A DeepSpeed release that moved or renamed it raises _Missing naming it, which
    spillway.deepspeed.install() turns into that part left to DeepSpeed."""
    if isinstance(owner, type):
        if name in owner.__dict__:
            return owner.__dict__[name]
        raise _Missing(f"{owner.__module__}.{owner.__qualname__}.{name} is not defined in this DeepSpeed "
                             f"(moved or renamed)")
    if not hasattr(owner, name):
        raise _Missing(f"{owner.__name__}.{name} is not defined in this DeepSpeed (moved or renamed)")
    return getattr(owner, name)


def _patch(owner, name, replacement):
    _patched.append((owner, name, _defined(owner, name)))
    setattr(owner, name, replacement)


def _unpatch_to(mark):
    """Restores every function patched after the first `mark` entries, newest first."""
    while len(_patched) > mark:
        owner, name, original = _patched.pop()
        setattr(owner, name, original)


def _deepspeed_version():
    import deepspeed  # noqa: PLC0415 (deepspeed is optional)

    return deepspeed.__version__
