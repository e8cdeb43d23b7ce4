"""benchmarks/gpu.py --smoke: the GPU benchmark's whole flow (synthetic GGUF written with gguf-py, three
paths loaded, decode timed, verify curve) runs on the CPU with tiny shapes, so a GPU session finds it working."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np

from outrider.io.gguf import GGUFFile

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


def _module():
    if "gpu_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
        sys.modules["gpu_bench"] = module = importlib.util.module_from_spec(spec)  # dataclasses look it up there
        spec.loader.exec_module(module)
    return sys.modules["gpu_bench"]


def test_smoke_prints_every_path_and_the_verify_curve(capsys, tmp_path):
    bench = _module()
    assert bench.main(["--smoke", "--models", "tiny-gemma3", "--quants", "Q4_0", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for variant in bench.VARIANTS:
        assert f"| tiny-gemma3 | Q4_0 | {variant} |" in out
    assert "| 16 | " in out  # the last row of c(k)/c(1)


def test_synthetic_models_have_the_declared_shapes(tmp_path):
    bench = _module()
    shape = bench.SHAPES["tiny-llama"]
    g = GGUFFile(bench.write_synthetic(tmp_path / "m.gguf", shape, "Q8_0"))
    assert g.tensors["blk.1.ffn_gate.weight"].shape == (shape.ffn, shape.hidden)
    assert g.tensors["output.weight"].type == gguf.GGMLQuantizationType.Q8_0
    w = g.load("blk.0.attn_q.weight").numpy()
    assert w.shape == (shape.heads * shape.head_dim, shape.hidden) and 0.01 < float(np.std(w)) < 0.03
