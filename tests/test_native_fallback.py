"""When the CPU kernels cannot be built: generation falls back to torch's ops with the same tokens, and the
failure is remembered, so a later process does not call the compiler again until asked to."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from outrider.io.gguf import GGUFFile
from outrider.models import load_model
from outrider.testing.fixtures import plain_greedy
from outrider.testing.tiny_models import write_tiny_llama

# a compiler that logs each call and fails, as a machine without a working g++ would
FAILING_CXX = '#!/bin/sh\necho "$@" >> "$FAKE_CXX_LOG"\nexit 1\n'

SECOND_PROCESS = """
import os, sys
from outrider import native
for retry in ("0", "1"):
    os.environ["OUTRIDER_NATIVE_RETRY"] = retry
    native.load.cache_clear()
    try:
        native.load()
    except native.NativeUnavailable as e:
        print(e)
    print(sum(1 for _ in open(os.environ["FAKE_CXX_LOG"])))
print("outrider.catalog" in sys.modules)
"""


@pytest.fixture
def failing_compiler(tmp_path):
    cxx = tmp_path / "failing-cxx"
    cxx.write_text(FAILING_CXX)
    cxx.chmod(0o755)
    log = tmp_path / "compiler-calls.txt"
    env = {**os.environ, "OUTRIDER_HOME": str(tmp_path / "home"), "CXX": str(cxx), "FAKE_CXX_LOG": str(log),
           "OMP_NUM_THREADS": "1"}
    for name in ("OUTRIDER_NATIVE", "OUTRIDER_NATIVE_RETRY"):
        env.pop(name, None)
    return env, log


def test_a_failed_build_falls_back_with_the_same_tokens_and_is_remembered(tmp_path, failing_compiler):
    env, log = failing_compiler
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    first = subprocess.run([sys.executable, "-m", "outrider", "generate", "--model", str(model), "--drafter", "none",
                            "-n", "12", "--json", "the the the"], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "could not build the CPU kernels" in first.stderr and "OUTRIDER_NATIVE_RETRY=1" in first.stderr
    assert "Traceback" not in first.stderr
    tried = len(log.read_text().splitlines())
    assert tried >= 1  # the build did reach the compiler
    out = json.loads(first.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == 12
    dense = load_model(GGUFFile(model), weights="dense")
    assert out["tokens"] == plain_greedy(dense, out["prompt_tokens"], 12)

    second = subprocess.run([sys.executable, "-c", SECOND_PROCESS], env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr
    remembered, calls_after, retried, calls_after_retry, catalog_imported = second.stdout.strip().splitlines()
    assert "remembered" in remembered and "OUTRIDER_NATIVE_RETRY=1" in remembered
    assert int(calls_after) == tried  # the marker answered: no compiler call
    assert "could not build" in retried and int(calls_after_retry) > tried  # asked to, it tries again
    assert catalog_imported == "False"  # the kernel build does not need the model catalog
