"""An optimized BLAS under MLX on Linux, whenever one is installed.

The ``mlx[cpu]`` wheel links netlib's reference BLAS (``mlx_cpu.libs/libblas-<hash>.so.3.10.0``): its
float32 GEMM, which the layerwise smoke runs on, is 20-90x slower than OpenBLAS on the same CPU
(docs/smoke.md, "The BLAS under MLX"). Its ``cblas_sgemm`` is an unversioned dynamic symbol, so a
library preloaded with ``LD_PRELOAD`` serves it instead. ``LD_PRELOAD`` is only read when a process
starts, so the command line (``mtpconvert ...``, ``python -m mtpconvert ...``) calls ``reexec()``
before anything imports mlx: where MLX links the reference BLAS and an optimized one is installed, it
re-executes the same command once, with that library appended to ``LD_PRELOAD``.

``MTPCONVERT_BLAS``: unset or ``auto`` (the above), ``off`` (never preload), or the path of a BLAS
library to preload whatever MLX links. A BLAS already in the user's ``LD_PRELOAD`` is left as it is; other
entries there are kept, ours goes after them. ``MTPCONVERT_BLAS_STATE`` records the decision (and stops a
second re-exec, in this process and in its children). ``notice()`` is the one line a command prints when
MLX computes on the reference BLAS. Stdlib only: this runs before mlx, numpy or anything heavy is imported.
"""

from __future__ import annotations

import glob
import os
import platform
import struct
import sys
import sysconfig
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

ENV = "MTPCONVERT_BLAS"
STATE_ENV = "MTPCONVERT_BLAS_STATE"
INSTALL_HINT = "apt-get install libopenblas0-pthread"

# Optimized BLAS libraries with the standard (unprefixed) CBLAS symbols, most wanted first. {arch}: the
# Debian multiarch directory name, e.g. x86_64-linux-gnu.
CANDIDATES = (
    "/usr/lib/{arch}/openblas-pthread/libopenblas.so.0",  # Debian, Ubuntu: libopenblas0-pthread
    "/usr/lib/{arch}/openblas-openmp/libopenblas.so.0",  # libopenblas0-openmp
    "/usr/lib/{arch}/libopenblas.so.0",  # the alternatives link to whichever is installed
    "/usr/lib64/libopenblasp.so.0",  # Fedora, RHEL: openblas-threads
    "/usr/lib64/libopenblaso.so.0",  # openblas-openmp
    "/usr/lib64/libopenblas.so.0",  # openblas (serial)
    "/usr/lib/libopenblas.so.0",  # Arch, Alpine
    "/usr/local/lib/libopenblas.so.0",  # built from source
)
# Names that say a library is an optimized BLAS (the library itself or the file a libblas.so.3 link reaches).
OPTIMIZED = ("openblas", "mkl", "blis", "atlas", "accelerate", "armpl", "nvpl")

# What the decision was (the STATE_ENV values):
PRELOADED = "preloaded"  # an optimized BLAS was put in LD_PRELOAD and the command re-executed
OPTIMIZED_LINKED = "optimized"  # MLX links an optimized BLAS itself: nothing to do
USER = "user"  # the user's LD_PRELOAD already has a BLAS
OFF = "off"  # MTPCONVERT_BLAS=off
REFERENCE = "reference"  # MLX links the reference BLAS and no optimized one was found
UNKNOWN = "unknown"  # not Linux, mlx not found, or its library unreadable: nothing to do


@dataclass(frozen=True)
class Decision:
    state: str
    library: Optional[str] = None  # the library to preload (PRELOADED), or the one MLX links
    preload: Optional[str] = None  # the LD_PRELOAD value the re-executed command runs with


# --------------------------------------------------------------------------- what MLX links


def _arch() -> str:
    return sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"


def elf_dynamic(path: str) -> Dict[str, List[str]]:
    """``{"needed": [...], "runpath": [...]}`` of a 64-bit little-endian ELF shared library, read from its
    program headers and dynamic section (a few KB, not the whole file). Raises ValueError for anything else."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        loads, dynamic = [], None
        for i in range(phnum):
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, _align = struct.unpack_from(
                "<IIQQQQQQ", table, i * phentsize)
            if p_type == 1:  # PT_LOAD
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == 2:  # PT_DYNAMIC
                dynamic = (p_offset, p_filesz)
        if dynamic is None:
            raise ValueError(f"{path}: no dynamic section")
        f.seek(dynamic[0])
        raw = f.read(dynamic[1])
        entries = [struct.unpack_from("<qQ", raw, i) for i in range(0, len(raw) - 15, 16)]
        strtab = next((v for tag, v in entries if tag == 5), None)  # DT_STRTAB, a virtual address
        if strtab is None:
            raise ValueError(f"{path}: no string table")
        base = next((off + strtab - va for va, off, size in loads if va <= strtab < va + size), None)
        if base is None:
            raise ValueError(f"{path}: string table outside its segments")

        def string(offset: int) -> str:
            f.seek(base + offset)
            data = f.read(4096)
            return data[:data.find(b"\0")].decode("utf-8", "replace")

        out: Dict[str, List[str]] = {"needed": [], "runpath": []}
        for tag, value in entries:
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                out["needed"].append(string(value))
            elif tag in (15, 29):  # DT_RPATH, DT_RUNPATH
                out["runpath"] += [p for p in string(value).split(":") if p]
        return out


def mlx_library() -> Optional[str]:
    """Path of MLX's core library (``mlx/lib/libmlx.so``), found without importing mlx; None if absent."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "lib", "libmlx.so")
        if os.path.isfile(path):
            return path
    return None


def _resolve(name: str, origin: str, runpath: Sequence[str]) -> Optional[str]:
    dirs = [p.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for p in runpath]
    dirs += os.environ.get("LD_LIBRARY_PATH", "").split(":")
    dirs += [f"/lib/{_arch()}", f"/usr/lib/{_arch()}", "/lib64", "/usr/lib64", "/lib", "/usr/lib"]
    for d in dirs:
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.realpath(os.path.join(d, name))
    return None


def is_optimized(path_or_name: str) -> bool:
    """An optimized BLAS by its file name. Not numpy's or scipy's bundled OpenBLAS (``libscipy_openblas*``):
    every symbol there is prefixed (``scipy_cblas_sgemm``), so it cannot serve MLX's ``cblas_sgemm``."""
    name = os.path.basename(path_or_name).lower()
    return "scipy_openblas" not in name and any(tag in name for tag in OPTIMIZED)


def linked_blas(library: Optional[str] = None) -> Optional[str]:
    """The BLAS library MLX's core library links, as the loader would find it (the file a ``libblas.so.3``
    link reaches); its bare name where it cannot be found; None when it links none (or is unreadable)."""
    library = library or mlx_library()
    if library is None:
        return None
    try:
        dyn = elf_dynamic(library)
    except (OSError, ValueError, struct.error):
        return None
    for name in dyn["needed"]:
        base = name.lower()
        if base.startswith("libblas") or base.startswith("libcblas") or is_optimized(base):
            return _resolve(name, os.path.dirname(os.path.realpath(library)), dyn["runpath"]) or name
    return None


def find_optimized(candidates: Sequence[str] = CANDIDATES) -> Optional[str]:
    """The first installed optimized BLAS of ``candidates`` (``{arch}`` filled in)."""
    for pattern in candidates:
        for path in sorted(glob.glob(pattern.format(arch=_arch()))):
            if os.path.isfile(path):
                return path
    return None


# --------------------------------------------------------------------------- the decision


def decide(environ: Mapping[str, str], linked: Optional[str], found: Optional[str]) -> Decision:
    """What to do, from the environment, the BLAS MLX links (``linked_blas``) and the optimized one found
    (``find_optimized``). Pure: the tests drive it with made-up paths."""
    choice = environ.get(ENV, "auto").strip() or "auto"
    user = [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if choice.lower() == "off":
        return Decision(OFF, linked)
    theirs = [p for p in user if is_optimized(p) or "blas" in os.path.basename(p).lower()]
    if theirs:
        return Decision(USER, theirs[0])
    if choice.lower() != "auto":  # a library the user names
        if not os.path.isfile(choice):
            return Decision(REFERENCE if linked and not is_optimized(linked) else UNKNOWN, linked)
        return Decision(PRELOADED, choice, ":".join(user + [choice]))
    if linked is None:
        return Decision(UNKNOWN)
    if is_optimized(linked):
        return Decision(OPTIMIZED_LINKED, linked)
    if found is None:
        return Decision(REFERENCE, linked)
    return Decision(PRELOADED, found, ":".join(user + [found]))


def reexec(argv: Optional[Sequence[str]] = None) -> Decision:
    """Decide once per process tree (``STATE_ENV``); where an optimized BLAS is to be preloaded, replace
    this process with the same command (``sys.orig_argv``) under that ``LD_PRELOAD``. Returns the decision
    where it does not re-execute (or the exec failed). Linux only; call before mlx is imported."""
    if not sys.platform.startswith("linux"):
        return Decision(UNKNOWN)
    done = os.environ.get(STATE_ENV)
    if done:
        return Decision(done)
    d = decide(os.environ, linked_blas(), find_optimized())
    os.environ[STATE_ENV] = d.state
    if d.state != PRELOADED:
        return d
    env = dict(os.environ, LD_PRELOAD=d.preload)
    args = list(argv if argv is not None else getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, args, env)
    except OSError:
        os.environ[STATE_ENV] = REFERENCE
        return Decision(REFERENCE, d.library)
    raise AssertionError("unreachable")  # pragma: no cover


def is_cli_process() -> bool:
    """This process was started as the command line: the ``mtpconvert`` script, or ``-m mtpconvert``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", "") == "mtpconvert.__main__":
        return True
    return os.path.basename(getattr(main, "__file__", "") or "") in ("mtpconvert", "mtpconvert.exe")


# --------------------------------------------------------------------------- what this process has


def mapped_blas() -> List[str]:
    """Files of BLAS libraries mapped into this process (``/proc/self/maps``; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if "blas" in os.path.basename(p).lower() or is_optimized(p))


def state() -> str:
    """This process's BLAS under MLX, one of the state names above: ``preloaded`` (or ``user``) only where an
    optimized BLAS is actually mapped (a preload the loader refused reads ``reference``)."""
    linked = linked_blas()
    if linked is None:
        return UNKNOWN
    if is_optimized(linked):
        return OPTIMIZED_LINKED
    if any(is_optimized(p) for p in mapped_blas()):
        return USER if os.environ.get(STATE_ENV) == USER else PRELOADED
    return USER if os.environ.get(STATE_ENV) == USER else REFERENCE


def notice() -> Optional[str]:
    """One line for a command's output where MLX computes on the reference BLAS, else None."""
    if state() != REFERENCE:
        return None
    slow = "its float32 GEMM runs 20-90x slower and the layerwise smoke of a large model reads fewer tokens"
    found = find_optimized()
    if found is None:
        return f"note: MLX computes on the reference BLAS (no OpenBLAS installed): {slow}; `{INSTALL_HINT}` fixes it"
    if os.environ.get(ENV, "").strip().lower() == "off":
        return f"note: MLX computes on the reference BLAS ({ENV}=off): {slow}; unset {ENV} to preload {found}"
    return f"note: MLX computes on the reference BLAS: {slow}; LD_PRELOAD={found} fixes it"


# Commands whose output the notice belongs in: those that run MLX on a model (unless told not to).
COMPUTING = ("convert", "pull-and-quantize", "recipe", "add-mtp", "smoke", "bench", "upload")


def startup(argv: Optional[Sequence[str]] = None) -> None:
    """The command line's hook (imported by ``mtpconvert.cli`` before mlx): in the process started as the
    command, and once per process tree, ``reexec``; where MLX stays on the reference BLAS, the command's
    output gets ``notice()`` once (commands that compute with MLX, without --no-smoke, --dry-run or --help)."""
    if not sys.platform.startswith("linux") or os.environ.get(STATE_ENV) or not is_cli_process():
        return
    d = reexec()
    args = list(sys.argv[1:] if argv is None else argv)
    if d.state not in (REFERENCE, OFF) or not args or args[0] not in COMPUTING:
        return
    if any(a in args for a in ("--no-smoke", "--dry-run", "--help", "-h")):
        return
    line = notice()
    if line:
        print(line, file=sys.stderr, flush=True)

