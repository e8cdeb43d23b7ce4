"""Outrider's compiled CPU kernels (the sources in `kernels/`), built on first use for the CPU they run on.

The sources are compiled once per machine with `-march=native` by torch's extension builder (g++ and
ninja) and cached under `$OUTRIDER_HOME/native/`, keyed by every source and header, torch's version and the
CPU's feature flags, so a second process loads them in milliseconds. The sources are copied into that folder
and compiled from there: torch's builder rebuilds whenever a source's path changes, which checkouts in
different folders sharing one cache would otherwise do by turns.

Every `.cpp` in `kernels/` is compiled into the module; its Python calls are declared in `kernels/api.h` and
bound in `kernels/bindings.cpp`.

A build holds an advisory lock on `build.lock` in that folder (`fcntl.flock`, released by the kernel when its
holder exits, however it exits): a second process waits for it, saying so, and a process that gets it knows
that torch's own lock file there (`lock`, left behind by a build that was killed) is stale and removes it,
where torch's builder would wait on it forever.

Where the build fails (no compiler, no ninja, a compile error) `load()` raises `NativeUnavailable` with the
reason, and the CPU backend falls back to torch's own ops. The failure is remembered in a marker file in
that folder, keyed by the compiler too, so later processes fall back at once instead of trying again;
deleting the marker, a different compiler (`CXX`) or ninja, or `OUTRIDER_NATIVE_RETRY=1` tries again.

`OUTRIDER_NATIVE_MARCH` builds for another CPU level than `native`; `OUTRIDER_NATIVE_CFLAGS` adds compiler
flags after Outrider's own, so that they win (`-g` to debug a kernel, `-O0` for a quick build). Both are part
of the key: each setting has its own build.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import platform
import shlex
import shutil
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from outrider.errors import ConfigError

KERNELS = Path(__file__).with_name("kernels")
RETRY_VARIABLE = "OUTRIDER_NATIVE_RETRY"


def cflags() -> list[str]:
    # OUTRIDER_NATIVE_MARCH builds for another CPU level (x86-64-v3: AVX2 only), which the tests use to
    # check the code paths this machine's -march=native would skip.
    flags = ["-O3", f"-march={os.environ.get('OUTRIDER_NATIVE_MARCH', 'native')}", "-fopenmp", "-ffp-contract=fast"]
    if compiler_is_gcc():
        # GCC's tunings for some CPUs (AMD Zen; by its failures, GCC 13's Sapphire Rapids) leave a
        # multiply-add unfused where it feeds an accumulation chain, loop by loop: two copies of one kernel
        # (attention for one and for three heads of a group) then rounded differently, and a verify pass
        # lost the bits of single steps. Fusing every one keeps -ffp-contract=fast the same whatever
        # -mtune says.
        flags.append("--param=avoid-fma-max-bits=0")
    try:
        return flags + shlex.split(os.environ.get("OUTRIDER_NATIVE_CFLAGS", ""))
    except ValueError as e:
        raise ConfigError(f"OUTRIDER_NATIVE_CFLAGS: {e}; quote it as a shell would") from None


def _compiler() -> str:
    """The C++ compiler torch's builder calls: `$CXX`, default c++."""
    return os.environ.get("CXX") or "c++"


def _which(tool: str) -> str | None:
    return shutil.which(tool.split()[0]) if tool.strip() else None


def compiler_is_gcc() -> bool:
    """By the compiler's resolved name, without running it (a remembered failed build calls no compiler):
    clang's names say clang; c++, g++ and x86_64-linux-gnu-g++-12 are GCC."""
    return "clang" not in os.path.basename(os.path.realpath(_which(_compiler()) or _compiler()))


class NativeUnavailable(RuntimeError):
    pass


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (its "flags" or "Features" line)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


# the CPU's vector extensions that decide which kernels run, as lscpu names them
VECTOR_EXTENSIONS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")


def vector_extensions() -> list[str]:
    """Which of VECTOR_EXTENSIONS this CPU has: what to print beside every speed figure."""
    flags = set(cpu_flags().split())
    return [name for name in VECTOR_EXTENSIONS if name in flags]


def sources() -> list[Path]:
    """The module's translation units: bindings.cpp first, the longest to compile (torch's Python headers), so
    that ninja starts it first; then by name."""
    return sorted(KERNELS.glob("*.cpp"), key=lambda path: (path.name != "bindings.cpp", path.name))


def _kernel_files() -> list[Path]:
    """Every file a build reads from `kernels/`: the sources and the headers they include."""
    return sorted(path for path in KERNELS.iterdir() if path.suffix in (".cpp", ".h"))


def build_key() -> str:
    import torch

    digest = hashlib.sha256()
    for path in _kernel_files():  # by name and length too: text moved between files changes the key
        text = path.read_bytes()
        digest.update(f"{path.name}\0{len(text)}\0".encode())
        digest.update(text)
    for part in (torch.__version__, " ".join(cflags()), cpu_flags(), platform.python_version()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def compiler_key() -> str:
    """The tools a build would use, as torch's builder finds them: `$CXX` (default c++) and ninja, by
    resolved path and modification time, so installing or upgrading either makes a remembered failure stale."""
    parts = []
    for tool in (_compiler(), "ninja"):
        found = _which(tool)
        parts += [tool, found or "-", str(os.stat(found).st_mtime_ns) if found else "-"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def failure_marker(folder: Path) -> Path:
    return folder / f"build-failed-{compiler_key()}.txt"


def _place_sources(folder: Path) -> list[Path]:
    """The sources and headers inside the build folder (the key holds their hash, so an existing copy is the
    same text); returns the sources there."""
    placed = folder / KERNELS.name
    placed.mkdir(exist_ok=True)
    for path in _kernel_files():
        target = placed / path.name
        if not target.is_file():
            with tempfile.NamedTemporaryFile("wb", dir=placed, delete=False) as tmp:
                tmp.write(path.read_bytes())
            os.replace(tmp.name, target)  # atomic: a process building beside this one never reads half a file
    return [placed / path.name for path in sources()]


@contextlib.contextmanager
def _build_lock(folder: Path):
    """Hold `folder`'s build lock for a block; while it is held no other process of ours builds there, so torch's
    own lock file, if one is there, was left by a build that died, and is removed."""
    import fcntl

    with open(folder / "build.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"outrider: another process is building the CPU kernels in {folder}; waiting for it",
                  file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            print(f"outrider: removing {stale}, left by a kernel build that was stopped", file=sys.stderr)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@functools.cache
def load():
    """The compiled kernels module: functions `linear`, `dequantize_rows`, `attend` and the class `LayerStack`
    (a model's layers in one call). Built on the first call in a process (or loaded from the cache), then
    the same module for the process; raises `NativeUnavailable` with a one-line reason."""
    if os.environ.get("OUTRIDER_NATIVE", "1") == "0":
        raise NativeUnavailable("disabled by OUTRIDER_NATIVE=0")
    from torch.utils import cpp_extension

    from outrider.paths import outrider_home

    key = build_key()
    folder = outrider_home() / "native" / key
    marker = failure_marker(folder)
    if marker.is_file() and os.environ.get(RETRY_VARIABLE) != "1":
        raise NativeUnavailable(f"{marker.read_text().strip()} (remembered; delete {marker} or set "
                                f"{RETRY_VARIABLE}=1 to try again)")
    folder.mkdir(parents=True, exist_ok=True)
    placed = _place_sources(folder)
    if not any(folder.glob("*.so")):
        print("outrider: building the CPU kernels for this machine (once, about a minute)", file=sys.stderr)
    log = io.StringIO()
    try:
        with _build_lock(folder), redirect_stdout(log), redirect_stderr(log):
            module = cpp_extension.load(name=f"outrider_kernels_{key}", sources=[str(path) for path in placed],
                                        extra_cflags=cflags(), extra_ldflags=["-fopenmp"], build_directory=str(folder),
                                        verbose=False)
    except Exception as e:  # a missing compiler or ninja, or a compile error: say which, in one line
        lines = [line for line in (str(e) + "\n" + log.getvalue()).splitlines() if line.strip()]
        reason = next((line for line in lines if "error:" in line), lines[-1] if lines else type(e).__name__)
        message = f"could not build the CPU kernels ({reason.strip()[:200]}); install g++ and ninja (pip install ninja)"
        marker.write_text(message + "\n")
        raise NativeUnavailable(f"{message}; remembered in {marker} (delete it or set {RETRY_VARIABLE}=1 to "
                                "try again)") from e
    marker.unlink(missing_ok=True)
    return module


PROBE = Path(__file__).with_name("probes") / "int8_product_rate.cpp"


@functools.cache
def product_rate_probe():
    """`int8_product_rate(seconds, signed_codes, float_steps)`: the products a second one core gives a row in
    this build's lane tiles on registers alone (0.0 without the int8 kernels), for benchmarks/activations.py
    --floor. Not part of the kernels' module: compiled on first use with the kernels' flags as a plain shared
    library (no torch headers: seconds), cached beside the module's builds, loaded with ctypes."""
    import ctypes
    import shlex
    import subprocess

    from outrider.paths import outrider_home

    digest = hashlib.sha256(PROBE.read_bytes() + (KERNELS / "isa.h").read_bytes())
    for part in (" ".join(cflags()), cpu_flags(), compiler_key()):
        digest.update(part.encode())
    folder = outrider_home() / "native" / f"probe-{digest.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / "int8_product_rate.so"
    with _build_lock(folder):
        if not library.is_file():
            partial = folder / f"int8_product_rate.{os.getpid()}.so"
            command = [*shlex.split(_compiler()), *shlex.split(" ".join(cflags())), "-shared", "-fPIC", str(PROBE),
                       "-o", str(partial)]
            built = subprocess.run(command, capture_output=True, text=True)
            if built.returncode != 0:
                raise NativeUnavailable(f"could not build the product-rate probe: {built.stderr.strip()[-300:]}")
            os.replace(partial, library)
    probe = ctypes.CDLL(str(library)).int8_product_rate
    probe.argtypes, probe.restype = [ctypes.c_double, ctypes.c_bool, ctypes.c_bool], ctypes.c_double
    return probe


ACTIVATION_MODES = ("auto", "int8", "float32")
_FLOAT32_HOOKS: list = []


def when_float32(hook) -> None:
    """`hook()` runs whenever float32 activations are set: weights held for int8 ones only (the lane
    form, `outrider.models.linear`) take their row form back."""
    _FLOAT32_HOOKS.append(hook)


def check_activations_mode(mode: str) -> None:
    if mode not in ACTIVATION_MODES:
        raise ConfigError(f"unknown activations mode '{mode}'; choose one of: {', '.join(ACTIVATION_MODES)}")


def use_activations(mode: str) -> bool:
    """Sets how the kernels meet quantized weights, for the whole process: `int8` quantizes each row of
    activations per 32 values first and multiplies in integers (llama.cpp's design: the fast path on AVX2);
    `float32` dequantizes the weights and multiplies in float32 (exact weights and activations); `auto` is
    int8 where this build prefers it (AVX2 without AVX-512, or AVX512-VNNI) and float32 elsewhere.
    Returns whether int8 is on. Raises ConfigError for an unknown mode or int8 on a build without the int8 kernels."""
    check_activations_mode(mode)
    kernels = load()
    on = kernels.PREFERS_INT8 if mode == "auto" else mode == "int8"
    if on and not kernels.HAS_INT8_KERNELS:
        raise ConfigError("activations=int8 needs a CPU with AVX2 and FMA (these kernels were built without "
                          "them); use -o backend.activations float32")
    kernels.set_int8_activations(on)
    if not on:
        for hook in _FLOAT32_HOOKS:
            hook()
    return on


def int8_flag() -> bool | None:
    """Whether the kernels meet quantized weights with int8 activations now; None where this process has not
    loaded the kernels (read without building them)."""
    return load().int8_activations() if load.cache_info().currsize else None


def set_int8_flag(on: bool | None) -> None:
    """Set that flag alone (None: leave it), changing no weight's form as `use_activations` does: for a
    second model in the process (a draft model) whose weights were loaded in the form its own mode reads."""
    if on is not None:
        load().set_int8_activations(on)


@contextlib.contextmanager
def activations(mode: str):
    """`use_activations(mode)` for a block, then the mode before it (tests, benchmarks comparing modes).
    Without kernels (they run dense) a float32 block changes nothing."""
    try:
        kernels = load()
    except NativeUnavailable:
        if mode == "int8":
            raise
        yield
        return
    before = kernels.int8_activations()
    use_activations(mode)
    try:
        yield
    finally:  # through use_activations: back to float32, weights made inside the block take their rows too
        use_activations("int8" if before else "float32")
