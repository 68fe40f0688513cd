"""Which torch builds share a C++ ABI (import-time check in __init__, spillway.install()'s in
_torch_allocators). This module is private and imports nothing, so it can run before the extension."""


def series(version):
    """What must match between the torch Spillway was built against and the running one: (major,
    minor) of a release (torch keeps its C++ ABI within a minor series: 2.13.1 runs a 2.13.0 build);
    the whole version of a development or pre-release build (2.13.0.dev20260101, 2.13.0a0,
    2.13.0rc1), whose ABI moves from build to build."""
    release = version.split("+")[0]
    parts = release.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return (release,)
    return tuple(parts[:2])
