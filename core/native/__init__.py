"""Outrider's compiled CPU kernels (`kernels.cpp`), built on first use for the CPU they run on.

The source is compiled once per machine with `-march=native` by torch's extension builder (g++ and
ninja) and cached under `$OUTRIDER_HOME/native/`, keyed by the source, torch's version and the CPU's
feature flags, so a second process loads it in milliseconds. Where no compiler is present `load()`
raises `NativeUnavailable` with the reason, and the CPU backend falls back to torch's own ops.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import platform
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.cpp")


def cflags() -> list[str]:
    # OUTRIDER_NATIVE_MARCH builds for another CPU level (x86-64-v3: AVX2 only), which the tests use to
    # check the code paths this machine's -march=native would skip.
    return ["-O3", f"-march={os.environ.get('OUTRIDER_NATIVE_MARCH', 'native')}", "-fopenmp", "-ffp-contract=fast"]


class NativeUnavailable(RuntimeError):
    pass


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build_key() -> str:
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, " ".join(cflags()), _cpu_flags(), platform.python_version()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


@functools.cache
def load():
    """The compiled kernels module: functions `linear`, `dequantize_rows`, `attend` and the class `LayerStack`
    (a model's layers in one call). Built on the first call in a process (or loaded from the cache), then
    the same module for the process; raises `NativeUnavailable` with a one-line reason."""
    if os.environ.get("OUTRIDER_NATIVE", "1") == "0":
        raise NativeUnavailable("disabled by OUTRIDER_NATIVE=0")
    from torch.utils import cpp_extension

    from ..catalog import outrider_home

    key = build_key()
    folder = outrider_home() / "native" / key
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):
        print("outrider: building the CPU kernels for this machine (once, about a minute)", file=sys.stderr)
    log = io.StringIO()
    try:
        with redirect_stdout(log), redirect_stderr(log):
            return cpp_extension.load(name=f"outrider_kernels_{key}", sources=[str(SOURCE)], extra_cflags=cflags(),
                                      extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    except Exception as e:  # a missing compiler or ninja, or a compile error: say which, in one line
        lines = [line for line in (str(e) + "\n" + log.getvalue()).splitlines() if line.strip()]
        reason = next((line for line in lines if "error:" in line), lines[-1] if lines else type(e).__name__)
        raise NativeUnavailable(f"could not build the CPU kernels ({reason.strip()[:200]}); "
                                "install g++ and ninja (pip install ninja)") from e
