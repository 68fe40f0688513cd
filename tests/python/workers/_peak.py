"""A save's or a conversion's peak host memory, as the save tests measure it (ds_save.py,
ds_trainer_save.py, zero_to_fp32_peak.py): VmHWM after `echo 5 > /proc/self/clear_refs` (which resets
it to the current RSS) less VmRSS before. Freed heap memory goes back to the OS first (malloc_trim),
so that an allocation during the call shows in RSS instead of reusing pages left resident."""
import ctypes


def status(key):
    """A /proc/self/status field in bytes (VmRSS, VmHWM, RssAnon, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak(fn):
    """(bytes fn() added to the process's peak RSS, fn's result)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    result = fn()
    return status("VmHWM") - before, result
