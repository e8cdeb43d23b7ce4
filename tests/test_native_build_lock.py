"""A kernel build that is stopped leaves nothing that blocks the next one: torch's lock file left by a killed
build is removed, a build in progress elsewhere is waited for with a message, and a build killed midway
builds again on the next run."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outrider import native

LOAD = "from outrider import native; m = native.load(); print('loaded', hasattr(m, 'LayerStack'))"


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "OUTRIDER_HOME": str(home), "OMP_NUM_THREADS": "1"}
    for name in ("OUTRIDER_NATIVE", "OUTRIDER_NATIVE_RETRY"):
        env.pop(name, None)
    return env


@pytest.fixture
def built_home():
    """This machine's kernel cache, built: a copy elsewhere would rebuild (torch's build file names its folder),
    so the checks below run on the cache itself, leaving it as they found it."""
    try:
        native.load()
    except native.NativeUnavailable as e:
        pytest.skip(f"no kernels on this machine: {e}")
    from outrider.paths import outrider_home

    home = outrider_home()
    folder = home / "native" / native.build_key()
    yield home, folder
    (folder / "lock").unlink(missing_ok=True)


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on(built_home):
    home, folder = built_home
    (folder / "lock").write_text("")  # what torch's builder leaves when its process is killed
    run = subprocess.run([sys.executable, "-c", LOAD], env=_env(home), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "loaded True" in run.stdout, run.stderr
    assert "left by a kernel build that was stopped" in run.stderr
    assert not (folder / "lock").exists()


def test_a_build_in_progress_elsewhere_is_waited_for_with_a_message(built_home):
    home, folder = built_home
    with open(folder / "build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process building now
        (folder / "lock").write_text("")  # its torch lock: live, so it must stay while we wait
        waiting = subprocess.Popen([sys.executable, "-c", LOAD], env=_env(home), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        err = ""
        while "waiting for it" not in err:
            assert time.monotonic() < deadline and waiting.poll() is None, err
            time.sleep(0.2)
            err = _read_available(waiting.stderr)
        assert (folder / "lock").exists() and waiting.poll() is None  # it waits; it does not remove a live lock
        (folder / "lock").unlink()  # the other build finishes and lets go
    out, rest = waiting.communicate(timeout=120)
    assert waiting.returncode == 0 and "loaded True" in out, err + rest


def _read_available(stream) -> str:
    import select

    text = ""
    while select.select([stream], [], [], 0)[0]:
        line = stream.readline()
        if not line:
            break
        text += line
    return text


@pytest.mark.slow
def test_a_build_killed_midway_builds_again_on_the_next_run(tmp_path, monkeypatch):
    try:
        native.load()
    except native.NativeUnavailable as e:
        pytest.skip(f"no kernels on this machine: {e}")
    monkeypatch.setenv("OUTRIDER_NATIVE_CFLAGS", "-O0")  # what is checked is the lock, not the code: a quick build
    home = tmp_path / "home"
    folder = home / "native" / native.build_key()
    first = subprocess.Popen([sys.executable, "-c", LOAD], env=_env(home), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (folder / "lock").exists() or not list(folder.glob("*.ninja")):  # the compiler is running
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.1)
    time.sleep(3)
    os.killpg(first.pid, signal.SIGKILL)  # the build, its ninja and compiler, at once, as `timeout -s KILL` would
    first.wait()
    assert (folder / "lock").exists() and not list(folder.glob("*.so"))
    again = subprocess.run([sys.executable, "-c", LOAD], env=_env(home), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "loaded True" in again.stdout, again.stderr


def test_extra_compiler_flags_come_after_ours_and_key_a_build_of_their_own(monkeypatch):
    monkeypatch.delenv("OUTRIDER_NATIVE_CFLAGS", raising=False)
    ours = native.cflags()
    key = native.build_key()
    monkeypatch.setenv("OUTRIDER_NATIVE_CFLAGS", "-O0 -g")
    assert native.cflags() == [*ours, "-O0", "-g"]  # after -O3: the compiler takes the last -O
    assert native.build_key() != key
