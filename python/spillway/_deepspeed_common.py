"""What spillway.deepspeed's install and its private parts (_deepspeed_step's fused step,
_deepspeed_audit's audit) share: the record of DeepSpeed's functions patched, which uninstall()
restores, and DeepSpeed's version. Private: spillway.deepspeed re-exports both, and the parts import
them from here rather than from the module that imports them.
"""
_patched = []       # (owner, name, original) for each function wrapped


def _patch(owner, name, replacement):
    _patched.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
    setattr(owner, name, replacement)


def _deepspeed_version():
    import deepspeed  # noqa: PLC0415 (deepspeed is optional)

    return deepspeed.__version__
