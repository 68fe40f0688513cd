"""The package as users install it: a version, type information whose names match the extension,
and an import under another torch that refuses with what to do instead of loading an extension of
another C++ ABI. Under scripts/test this file, like every other, runs against the pip-installed
package (conftest.py checks it)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spillway

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_projects():
    want = re.search(r"project\(spillway VERSION ([0-9.]+)", (ROOT / "CMakeLists.txt").read_text()).group(1)
    assert spillway.__version__ == want


def test_the_stub_names_every_public_name_of_the_extension():
    pkg = Path(spillway.__file__).parent
    assert (pkg / "py.typed").exists()
    stub = (pkg / "_spillway.pyi").read_text()
    public = [n for n in dir(spillway._spillway) if not n.startswith("_")]
    missing = [n for n in public if not re.search(rf"\b{n}\b", stub)]
    assert not missing, f"_spillway.pyi lacks {missing}: regenerate it (its header says how)"


def test_the_stub_is_python_a_type_checker_can_read():
    # mypy and pyright parse the stub as Python: one parameter named after a keyword (DeepSpeed's
    # "async") made the whole file a syntax error for them.
    import ast

    stub = Path(spillway.__file__).parent / "_spillway.pyi"
    ast.parse(stub.read_text(), filename=str(stub))


def test_an_import_under_another_torch_refuses_and_says_to_rebuild():
    code = "import torch; torch.__version__ = '2.99.1+cpu'; import spillway"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "ImportError" in out.stderr
    assert "was built against torch" in out.stderr and "2.99.1" in out.stderr
    assert "pip install --no-build-isolation" in out.stderr
    assert "Segmentation fault" not in out.stderr


def test_a_patch_release_of_the_same_torch_is_accepted():
    spillway._check_torch("2.13.0", "2.13.1+cpu")  # no error: same minor version


def test_a_development_build_must_be_the_one_spillway_was_built_against():
    # A nightly's C++ ABI moves from build to build: the same minor is not enough.
    spillway._check_torch("2.13.0.dev20260101+cpu", "2.13.0.dev20260101+cpu")
    with pytest.raises(ImportError, match="2.13.0.dev20260102"):
        spillway._check_torch("2.13.0.dev20260101+cpu", "2.13.0.dev20260102+cpu")
    with pytest.raises(ImportError, match="2.13.0rc1"):
        spillway._check_torch("2.13.0", "2.13.0rc1")


def test_install_accepts_a_patch_release_and_refuses_another_minor_with_the_pip_command():
    """torch keeps its C++ ABI within a minor series: spillway.install() under 2.13.x of a 2.13.0
    build replaces torch's allocators; under another minor it refuses and says how to rebuild."""
    patch = ("import torch, spillway; torch.__version__ = spillway._build_info.torch_version.rsplit('.', 1)[0] + "
             "'.9+cpu'; spillway.check_torch_version(); print('accepted', torch.__version__)")
    out = subprocess.run([sys.executable, "-c", patch], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "accepted" in out.stdout, out.stderr[-2000:]
    minor = "import torch, spillway; torch.__version__ = '2.99.0+cpu'; spillway.check_torch_version()"
    out = subprocess.run([sys.executable, "-c", minor], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "FailedPrecondition" in out.stderr and "2.99.0" in out.stderr, out.stderr[-2000:]
    assert "pip install --no-build-isolation" in out.stderr, out.stderr[-2000:]


def test_the_extensions_cxx_runtime_calls_bind_to_libstdcxx_not_to_torchs_copies(tmp_path):
    """torch's libraries export C++ runtime template instantiations built with torch's own
    toolchain (std::basic_ostringstream's constructor, std::filesystem pieces). An extension whose
    std:: calls bind to them builds a stream with torch's copy and formats an integer into it with
    the system libstdc++: the mix that is the suspected cause of the GPU image's segfaults
    (docs/python.md). The dynamic linker's own record of each binding says where they went."""
    code = ("import spillway; a = spillway.HostArena(budget_bytes=1 << 22, pinned=False); "
            "a._begin_epoch(0); print(a._end_epoch()['text'])")
    # LD_BIND_NOW: every symbol the extension imports is bound at load, not only those this run calls.
    env = {**__import__("os").environ, "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(tmp_path / "ld"),
           "LD_BIND_NOW": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "end of epoch 0" in p.stdout
    lines = [line for f in tmp_path.glob("ld.*") for line in f.read_text(errors="replace").splitlines()]
    ours = [line for line in lines if "binding file" in line and "_spillway" in line.split(" to ")[0]]
    assert ours, "LD_DEBUG recorded no binding of the extension"
    # std:: names, and the abbreviations std::string (Ss), allocator (Sa), istream/ostream/iostream
    # (Si, So, Sd), in functions, vtables, VTTs, typeinfo and typeinfo names.
    runtime = re.compile(r"symbol `_Z(N|NK|T[TVIS])?S[tabsiod]")
    # Empty tag objects carry no state, so which library's copy a reference binds to does not matter
    # (a Release build's reference to std::piecewise_construct bound to libtorch_python's copy).
    stateless = ("`_ZSt19piecewise_construct'", "`_ZSt7nothrow'", "`_ZSt13allocator_arg'")
    to_torch = [line.split(" to ", 1)[1] for line in ours
                if runtime.search(line) and "/torch/lib/" in line.split(" to ", 1)[1]
                and not line.rstrip().endswith(stateless)]
    assert not to_torch, f"{len(to_torch)} C++ runtime symbols of the extension bind to torch's libraries: {to_torch[:5]}"


# std:: names (see the test above), and the runtime's own: exceptions, RTTI, operator new and delete.
RUNTIME = re.compile(r"symbol `(_Z(N|NK|T[TVIS])?S[tabsiod]|__cxa_|__gxx_personality|__dynamic_cast|_Zn[wa]|_Zd[la])")


def test_a_library_exporting_its_own_cxx_runtime_serves_none_of_the_extensions_std_calls(tmp_path):
    """The GPU image's segfaults (docs/results/gpu-findings.md): a library loaded into the global
    scope before the extension (there, by CUDA torch's RTLD_GLOBAL loads) that exports its own copy
    of the C++ runtime serves every later library's std:: calls the dynamic linker resolves, whatever order
    their own dependencies are listed in: a stream built by that copy is then read through another
    runtime's locale. Here such a library (libstdc++ linked in statically, nothing hidden) is
    loaded RTLD_GLOBAL before torch; the control is torch's own libraries, whose std:: calls it
    takes. The extension's must not leave the extension."""
    foreign = os.environ.get("SPILLWAY_FOREIGN_CXX_RUNTIME_LIB")
    if not foreign:
        pytest.skip("SPILLWAY_FOREIGN_CXX_RUNTIME_LIB is unset: ctest sets it to the library tests/CMakeLists.txt builds")
    code = ("import ctypes, sys; ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL); import torch, spillway; "
            "a = spillway.HostArena(budget_bytes=1 << 22, pinned=False); a._begin_epoch(0); "
            "print(a._end_epoch()['text'])")
    env = {**os.environ, "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(tmp_path / "ld"), "LD_BIND_NOW": "1"}
    p = subprocess.run([sys.executable, "-c", code, foreign], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "end of epoch 0" in p.stdout
    lines = [line for f in tmp_path.glob("ld.*") for line in f.read_text(errors="replace").splitlines()
             if "binding file" in line and RUNTIME.search(line)]
    name = os.path.basename(foreign)
    torch_to_foreign = [line for line in lines if "/torch/lib/" in line.split(" to ")[0] and name in line.split(" to ")[1]]
    assert torch_to_foreign, "control: none of torch's std:: calls went to the foreign runtime; the setup shows nothing"
    # glibc's own __cxa_atexit, __cxa_finalize and __cxa_thread_atexit_impl, and __cxa_pure_virtual,
    # which only aborts (a pure virtual call): none of them holds the runtime's state.
    elsewhere = [line for line in lines if "_spillway" in line.split(" to ")[0] and "_spillway" not in line.split(" to ")[1]]
    ours = [line for line in elsewhere if "/libc.so" not in line.split(" to ")[1] and "`__cxa_pure_virtual'" not in line]
    assert not ours, f"{len(ours)} of the extension's std:: calls bind outside it, e.g. {ours[:3]}"


def test_public_classes_and_functions_name_the_module_users_import_them_from():
    # Re-exported from private modules (_torch_allocators, _deepspeed_*): help(), repr and error
    # messages must show the name users write, not the private file's.
    import spillway.deepspeed

    wrong = []
    for mod in (spillway, spillway.deepspeed):
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("_") or not (isinstance(obj, type) or callable(obj)):
                continue
            origin = getattr(obj, "__module__", None) or ""
            if origin.startswith("spillway._") and not origin.startswith("spillway._spillway"):
                wrong.append(f"{mod.__name__}.{name} says {origin}")
    assert not wrong, wrong


def test_crc32c_is_the_castagnoli_checksum_and_continues_across_chunks():
    from spillway import _spillway

    assert _spillway.crc32c(b"123456789") == 0xE3069283
    a, b = os.urandom(1000), os.urandom(3001)
    assert _spillway.crc32c(b, _spillway.crc32c(a)) == _spillway.crc32c(a + b)
    assert _spillway.crc32c(memoryview(bytearray(a + b))[1000:]) == _spillway.crc32c(b)
    with pytest.raises(BufferError):  # a strided view would be summed out of order
        _spillway.crc32c(memoryview(bytearray(a))[::2])
    with pytest.raises(TypeError):
        _spillway.crc32c("text is not bytes")
