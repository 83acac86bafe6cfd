"""Building the compiled kernels once, into the user cache, and loading them.

The kernels are C++ (`csrc/`): one translation unit per instruction set (portable C, AVX2,
AVX-512, AVX-512 VNNI), each under its own `#pragma GCC target`, chosen at run time by what the
CPU has; `ops.cpp` registers them as the torch operators `torch.ops.multidecode.*`. They are
built with torch's own extension builder (`torch.utils.cpp_extension.load`: the compiler flags
and the ABI of the installed torch) into `<user cache>/kernels/<key>/`, the key a hash of the
sources, the flags and the torch version: a changed source or another torch builds afresh, and a
built library is loaded straight from its file (milliseconds). `make setup` builds it
(`python -m multidecode.kernels`), so no command waits for a compiler.

Where there is no compiler (or the build fails), `load_library` returns None and says why, and the
package runs on the portable torch path (`kernels.portable`).

`-ffp-contract=off` keeps the compiler from fusing a multiply and an add into one fma where the
source has two operations: each kernel's arithmetic is exactly what its source says.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..user_cache import cache_dir, unwritable

NAME = "multidecode_kernels"
SOURCES = ("ops.cpp", "kernels_portable.cpp", "kernels_avx2.cpp", "kernels_avx512.cpp", "kernels_avx512vnni.cpp")
HEADERS = ("kernels.h", "kernels_impl.h", "lanes.h")
CFLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp", "-Wno-maybe-uninitialized")
LDFLAGS = ("-fopenmp",)
DONE = "built"
"""The file a finished build leaves beside its library (a folder without it is rebuilt)."""
KERNELS_FOLDER = "kernels"
"""The folder of the user cache that holds one folder per build (`<key>/`)."""
BUILD_LOCK = "build.lock"
"""The lock a build holds in its folder while it compiles (`multidecode cache clear` respects it)."""

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"


@dataclass(frozen=True)
class Built:
    """The outcome of `load_library`: the library's path, or why there is none."""

    library: Path | None
    reason: str = ""


def key() -> str:
    """The hash naming a build: sources, headers, flags and the torch it is built against."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def build_folder() -> Path:
    return cache_dir() / KERNELS_FOLDER / key()


def library_path() -> Path:
    return build_folder() / f"{NAME}.so"


def built() -> bool:
    """Whether this build's library is there, finished and whole: a build that stopped half-way
    leaves no mark beside it, and a library cut short or overwritten since (its mark names its
    SHA-256) is built again rather than loaded (loading a truncated library kills the process)."""
    path, mark = library_path(), library_path().parent / DONE
    try:
        return mark.read_text(encoding="utf-8").split() == [key(), _digest(path)]
    except OSError:
        return False


def _digest(path: Path) -> str:
    """The SHA-256 of the file at `path` (a few milliseconds for the library's 2 MB)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _mark_built(path: Path) -> None:
    """Write the library's mark (the build key and the library's digest) once the library is on
    disk for good: flushed first, the mark written whole (a temporary file renamed)."""
    with open(path, "rb+") as library:
        os.fsync(library.fileno())
    mark = path.parent / DONE
    partial = mark.with_name(f".{DONE}.{os.getpid()}")
    partial.write_text(f"{key()}\n{_digest(path)}\n", encoding="utf-8")
    os.replace(partial, mark)


def compiler() -> str | None:
    """The C++ compiler torch's builder would use, if it is on this machine."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def load_library(*, build: bool = True, progress: Callable[[str], None] | None = None) -> Built:
    """Load the compiled kernels into this process (building them first where `build` and they
    are not built yet). Returns where the library is, or, with `library` None, why there is none.
    progress: told what is happening before a build starts (a build takes a minute)."""
    if hasattr(torch.ops.multidecode, "qlinear"):
        return Built(library_path())
    path = library_path()
    if built():
        torch.ops.load_library(str(path))
        return Built(path)
    if not build:
        return Built(None, "the kernels are not built yet (python -m multidecode.kernels builds them)")
    if compiler() is None:
        return Built(None, "no C++ compiler was found (install g++ and run `python -m multidecode.kernels`)")
    return _build(path, progress)


def _build(path: Path, progress: Callable[[str], None] | None) -> Built:
    """Compile under a lock (test workers and parallel commands build once), then load."""
    from filelock import FileLock
    from torch.utils.cpp_extension import load as build_extension

    err = unwritable(path.parent)  # a cache folder that is a file, or read-only: no build, the portable path
    if err is not None:
        return Built(None, f"the kernels cannot be built in {path.parent} ({err}); set MULTIDECODE_CACHE to a "
                           "folder you can write to")
    with FileLock(str(path.parent / BUILD_LOCK)):
        if not built():
            path.unlink(missing_ok=True)  # one cut short: the builder would take it as up to date
            if progress is not None:
                progress("Compiling multidecode's kernels for this CPU (once, about a minute)")
            try:
                build_extension(name=NAME, sources=[str(SOURCE_DIR / s) for s in SOURCES],
                                extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                                build_directory=str(path.parent), is_python_module=False, verbose=False)
            except (RuntimeError, OSError, ImportError) as err:  # a compiler that fails: the portable path
                return Built(None, f"compiling the kernels failed ({str(err).strip().splitlines()[-1][:200]})")
            _mark_built(path)
            return Built(path)
    torch.ops.load_library(str(path))
    return Built(path)


__all__ = ["BUILD_LOCK", "KERNELS_FOLDER", "Built", "build_folder", "built", "key", "library_path", "load_library"]
