"""`outrider bench` on a tiny GGUF file with Outrider only: report structure, medians, table and JSON."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

from outrider import bench
from outrider.bench.results import PAIRED_COLUMNS
from outrider.cli import main
from outrider.errors import ConfigError
from outrider.testing.tiny_models import write_tiny_llama

SHORT_PROMPTS = {"code": "def f(x):\n    return x + 1\n\ndef f(x):\n", "story": "Once upon a time"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("bench") / "tiny.gguf")


@pytest.fixture
def short_prompts(monkeypatch):
    # the tiny model's context is 256 byte-level tokens: the real prompts do not fit
    monkeypatch.setattr(bench.prompts, "PROMPTS", SHORT_PROMPTS)


def test_median_of_hand_values():
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert bench.median([None, 5.0, None]) == 5.0
    assert bench.median([None]) is None


def test_run_result_definitions_are_the_same_for_every_engine():
    r = bench.RunResult(prefill_s=0.5, decode_s=2.0, n_prompt=100, n_generated=9, drafted=10, accepted=4, rounds=4)
    assert r.prefill_tokens_per_s == 200.0
    assert r.decode_tokens_per_s == 4.0  # (9 - 1) tokens after the first / 2 s
    assert r.acceptance_rate == 0.4
    assert r.mean_acceptance_length == 2.0
    several_first = bench.RunResult(0.5, 2.0, 100, 9, n_first=3)
    assert several_first.decode_tokens_per_s == 3.0
    assert several_first.acceptance_rate is None and several_first.mean_acceptance_length is None
    assert bench.RunResult(1.0, 1.0, 1, 2, drafted=0, accepted=0, rounds=1).acceptance_rate is None
    assert bench.RunResult(1.0, 0.001, 1, 8, n_first=8).decode_tokens_per_s is None  # all in the first delivery

    runs = [bench.RunResult(1.0, d, 10, 5) for d in (1.0, 4.0, 2.0)]
    m = bench.medians(runs)
    assert m["decode_tokens_per_s"] == 2.0 and m["prefill_tokens_per_s"] == 10.0
    assert m["acceptance_rate"] is None


def _cell(prompt, temperature, config, decode, prefill=None, top_p=1.0):
    runs = [{"decode_tokens_per_s": d, "prefill_tokens_per_s": p}
            for d, p in zip(decode, prefill or [100.0] * len(decode))]
    return {"prompt": prompt, "temperature": temperature, "top_p": top_p, "config": config, "engine": config.split("+")[0],
            "median": {"decode_tokens_per_s": bench.median(decode)}, "runs": runs}


def test_ratios_pair_prompt_temperature_and_round():
    cells = [_cell("code", 0.0, "llama.cpp", [50.0, 40.0, 100.0], [200.0, 100.0, 400.0]),
             _cell("code", 0.0, "outrider", [25.0, 30.0, 40.0], [100.0, 300.0, 100.0]),
             _cell("code", 0.0, "outrider+lookup", [50.0, 90.0, 60.0]),
             _cell("code", 0.0, "transformers", [5.0, 10.0, 10.0]),
             _cell("code", 0.7, "outrider", [25.0]),
             _cell("code", 0.7, "llama.cpp", [50.0], top_p=0.95),
             _cell("code", 0.7, "outrider", [20.0], top_p=0.95)]
    bench.results.add_ratios(cells)
    # per round 0.5, 0.75, 0.4: median 0.5 (the ratio of the medians, 30 / 50, would be 0.6)
    assert [c["median"]["ratio_to_llama_cpp"] for c in cells[:5]] == [1.0, 0.5, 1.0, 0.1, None]  # lookup: 1, 2.25, 0.6
    plain, lookup = cells[1]["paired"], cells[2]["paired"]
    assert plain["vs_outrider_plain"] is None and lookup["vs_outrider_plain"] == 2.0  # 2, 3, 1.5
    assert plain["vs_transformers"] == 4.0  # 5, 3, 4
    assert lookup["vs_transformers"] is None and lookup["vs_llama_cpp_lookup"] is None  # not in the run
    assert plain["prefill_vs_llama_cpp"] == 0.5  # 0.5, 3, 0.25
    assert "paired" not in cells[0] and cells[4]["paired"]["vs_llama_cpp"] is None
    assert cells[6]["median"]["ratio_to_llama_cpp"] == 0.4  # paired with the top-p cell, not plain T=0.7


def test_sampling_specs_read_temperature_and_top_p():
    assert bench.Sampling.parse("0.7@0.95") == bench.Sampling(0.7, 0.95)
    assert bench.Sampling.parse(" 0 ") == bench.Sampling(0.0, 1.0)
    assert [str(s) for s in bench.DEFAULT_SAMPLINGS] == ["0", "0.7", "0.7@0.95"]
    for spec, message in [("hot", "T or T@top_p"), ("0.7@", "T or T@top_p"), ("-1", ">= 0"),
                          ("0.7@1.5", "(0, 1]"), ("0.7@0", "(0, 1]"), ("0@0.9", "temperature above 0")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            bench.Sampling.parse(spec).check()


def test_tensor_bytes_counts_each_storage_once_and_skips_embeddings():
    class Layer:
        pass

    class Model:
        pass

    w = torch.zeros(10, 10)
    layer = Layer()
    layer.wq, layer.alias, layer.view = w, w, w[2:]
    model = Model()
    model.layers = [layer]
    model.token_embd = torch.zeros(100, dtype=torch.uint8)
    Layer.__module__ = Model.__module__ = "outrider.test_fake"
    assert bench.tensor_bytes(model) == 400
    model.output = model.token_embd  # a tied head is read every token
    assert bench.tensor_bytes(model) == 500


def test_bench_on_a_tiny_model(tiny, short_prompts, tmp_path):
    settings = bench.BenchSettings(models=[str(tiny)], tokens=4, runs=2, prompts=["code", "story"],
                                   samplings=[bench.Sampling(0.0), bench.Sampling(0.7, 0.95)],
                                   engines=["outrider"], drafters=["none", "lookup"],
                                   bandwidth=False)
    report = bench.run_bench(settings, echo=lambda line: None)
    entry = report["models"][str(tiny)]
    assert entry["chat_template"] is False  # the tiny file has none: raw text
    assert len(entry["cells"]) == 2 * 2 * 2
    for cell in entry["cells"]:
        assert len(cell["runs"]) == 2
        for run in cell["runs"]:
            assert run["n_generated"] == 4 and run["n_first"] == 1
        decode = sorted(r["decode_tokens_per_s"] for r in cell["runs"])
        assert cell["median"]["decode_tokens_per_s"] == pytest.approx(sum(decode) / 2)
        assert cell["median"]["ratio_to_llama_cpp"] is None
        if cell["config"] == "outrider":  # plain decoding drafts nothing: no acceptance to report
            assert cell["median"]["acceptance_rate"] is None
            assert cell["median"]["mean_acceptance_length"] is None
        else:
            assert cell["median"]["mean_acceptance_length"] >= 1.0
            assert all("chosen_draft_lengths" in r["extra"] for r in cell["runs"])
    assert entry["held_weight_bytes"] > 0 and entry["stored_weight_bytes"] > 0

    table = bench.markdown(report)
    rows = [line for line in table.splitlines() if line.startswith("| code") or line.startswith("| story")]
    # the main table, then the paired ratios of every Outrider cell (all 8 here)
    assert len(rows) == 16 and all(line.count("|") == 9 for line in rows[:8])
    assert all(line.count("|") == 4 + len(PAIRED_COLUMNS) for line in rows[8:])
    assert "| prompt | T | engine | vs Outrider plain |" in table
    assert "| story | 0.7@0.95 | outrider+lookup |" in table and "what chat front-ends send" in table
    assert {(c["temperature"], c["top_p"]) for c in entry["cells"]} == {(0.0, 1.0), (0.7, 0.95)}
    path = tmp_path / "bench.json"
    bench.write_json(report, path)
    assert json.loads(path.read_text())["models"][str(tiny)]["cells"][0]["runs"]


def test_cli_bench_writes_table_json_and_notes_missing_peers(tiny, short_prompts, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_peers(name, *args, **kwargs):
        if name.split(".")[0] in ("llama_cpp", "transformers"):
            raise ImportError(f"No module named '{name}'", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peers)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--models", str(tiny), "--tokens", "3", "--runs", "1",
                                       "--prompts", "story", "--temperatures", "0", "--drafters", "none",
                                       "--no-bandwidth", "--json-out", str(out), "--chart", ""])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("`outrider bench --models ")
    assert "| story | 0 | outrider |" in result.output
    assert "llama.cpp skipped" in result.output and "transformers skipped" in result.output
    data = json.loads(out.read_text())
    assert data["command"].startswith("outrider bench")
    assert [c["config"] for c in data["models"][str(tiny)]["cells"]] == ["outrider"]


def test_cli_bench_rejects_unknown_names_in_one_line(tiny):
    result = CliRunner().invoke(main, ["bench", "--models", str(tiny), "--engines", "vllm", "--chart", ""])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == ["error: unknown engine 'vllm'; choose from outrider, llama.cpp, llama-bench, "
                                                  "transformers"]
    result = CliRunner().invoke(main, ["bench", "--models", str(tiny), "--temperatures", "0,0@0.9", "--chart", ""])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == ["error: top-p needs a temperature above 0 (greedy ignores it), "
                                                  "got 0@0.9"]


def test_llama_cpp_adapter_counts_rounds_with_a_fake_library(monkeypatch):
    """The adapter's contract with llama-cpp-python, without it: reset before each run (no prefix reuse),
    all warpers off, exactly n tokens, and draft rounds counted through the draft model's calls."""
    import sys
    import types

    import numpy as np

    calls = {}

    class FakeLookup:
        def __init__(self, num_pred_tokens):
            self.n = num_pred_tokens

        def __call__(self, input_ids):
            return np.array([7] * 3)

    class FakeLlama:
        def __init__(self, **kwargs):
            calls["init"] = kwargs
            self.draft_model = kwargs.get("draft_model")

        def reset(self):
            calls["reset"] = calls.get("reset", 0) + 1

        def set_seed(self, seed):
            calls["seed"] = seed

        def generate(self, tokens, **kwargs):
            calls["generate"] = kwargs
            yield 1  # after the prefill
            while True:  # each round: a draft of 3, of which 2 are accepted, then the recovered token
                self.draft_model(np.array(tokens))
                yield from (7, 7, 2)

    llama_cpp = types.ModuleType("llama_cpp")
    llama_cpp.Llama = FakeLlama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = FakeLookup
    monkeypatch.setitem(sys.modules, "llama_cpp", llama_cpp)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)

    engine = bench.LlamaCppEngine("model.gguf", threads=2, lookup=True)
    engine.load()
    assert calls["init"]["logits_all"] is True and calls["init"]["n_threads_batch"] == 2
    result = engine.run([5, 6, 7], 7, 0.7, 0.95, seed=3)
    assert calls["reset"] == 1 and calls["seed"] == 3
    assert calls["generate"]["temp"] == 0.7 and calls["generate"]["top_k"] == 0 and calls["generate"]["top_p"] == 0.95 and calls["generate"]["min_p"] == 0
    assert result.n_generated == 7 and result.n_prompt == 3
    assert (result.rounds, result.drafted, result.accepted) == (2, 6, 4)
    assert result.mean_acceptance_length == 3.0 and result.acceptance_approximate


def test_bench_drafter_list_tells_a_combination_from_a_list():
    from outrider.bench import BenchSettings
    from outrider.errors import ConfigError

    BenchSettings(drafters=["none", "lookup", "mtp", "lookup+mtp"]).check()
    for bad in ("lookup+nope", "none+mtp", "lookup,mtp"):
        with pytest.raises(ConfigError, match="join"):
            BenchSettings(drafters=[bad]).check()


FAKE_LLAMA_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
with open({log!r}, "a") as log:
    log.write(" ".join(args) + "\\n")
if {fail}:
    print("error: failed to load model", file=sys.stderr)
    sys.exit(3)
if "," in value("-p"):  # a cost curve: a k-token forward after -d tokens takes 10 ms x (1 + (k - 1) / 10)
    tests = [{{"n_prompt": k, "n_gen": 0, "n_depth": int(value("-d")), "avg_ts": k / (0.01 * (1 + (k - 1) / 10))}}
             for k in map(int, value("-p").split(","))]
    # and, last, a test at another depth and speed, which the cost curve must not read
    print(json.dumps(tests + [{{"n_prompt": 1, "n_gen": 0, "n_depth": 0, "avg_ts": 1.0}}]))
    sys.exit(0)
# prompt processing at 400 tok/s, generation at 50 tok/s, as llama-bench -o json lists its tests
print(json.dumps([{{"n_prompt": int(value("-p")), "n_gen": 0, "n_depth": 0, "avg_ts": 400.0}},
                  {{"n_prompt": 0, "n_gen": int(value("-n")), "n_depth": 0, "avg_ts": 50.0}}]))
"""


def _fake_llama_bench(tmp_path, fail=False):
    import stat
    import sys

    path, log = tmp_path / "llama-bench", tmp_path / "calls.log"
    path.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log), fail=fail))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path, log


def test_llama_bench_engine_runs_the_binary_and_reads_its_two_tests(tmp_path, monkeypatch):
    """The contract with llama-bench's command line and JSON, hand-checked: -p the prompt's length, -n the
    new tokens after the first (which counts to prefill, as for every engine), one repetition; its tok/s
    become the same RunResult definitions as the other engines'."""
    path, log = _fake_llama_bench(tmp_path)
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    engine = bench.make_engines(["llama-bench"], ["none"], "model.gguf", 2, llama_bench=str(path))[0]
    engine.load()
    result = engine.run(list(range(40)), 9, 0.7, 1.0, 1)
    assert log.read_text().split() == ["-m", "model.gguf", "-t", "2", "-p", "40", "-n", "8", "-d", "0", "-r", "1",
                                       "-o", "json"]
    assert result.prefill_tokens_per_s == pytest.approx(400.0)
    assert result.decode_tokens_per_s == pytest.approx(50.0)
    assert (result.n_prompt, result.n_generated, result.n_first) == (40, 9, 1)
    monkeypatch.setenv("LLAMA_BENCH", str(path))  # the variable, when no path is given
    assert bench.make_engines(["llama-bench"], ["none"], "model.gguf", 2)[0].binary == str(path)


def test_llama_bench_engine_failures_are_one_line(tmp_path, monkeypatch):
    from outrider.errors import OutriderError

    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    with pytest.raises(FileNotFoundError, match="pass --llama-bench PATH or set LLAMA_BENCH"):
        bench.make_engines(["llama-bench"], ["none"], "m.gguf", 1)[0].load()
    with pytest.raises(FileNotFoundError, match="not an executable llama-bench"):
        bench.make_engines(["llama-bench"], ["none"], "m.gguf", 1, llama_bench=str(tmp_path))[0].load()
    path, _ = _fake_llama_bench(tmp_path, fail=True)
    engine = bench.make_engines(["llama-bench"], ["none"], "m.gguf", 1, llama_bench=str(path))[0]
    engine.load()
    with pytest.raises(OutriderError, match="llama-bench exited with 3: error: failed to load model"):
        engine.run([1, 2, 3], 4, 0.0, 1.0, 1)


def test_cli_bench_puts_llama_bench_beside_outrider(tiny, short_prompts, tmp_path):
    path, _ = _fake_llama_bench(tmp_path)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--models", str(tiny), "--tokens", "3", "--runs", "1",
                                       "--prompts", "story", "--temperatures", "0", "--drafters", "none",
                                       "--engines", "outrider,llama-bench", "--llama-bench", str(path),
                                       "-o", "backend.weights", "dense",
                                       "--no-bandwidth", "--json-out", str(out), "--chart", ""])
    assert result.exit_code == 0, result.output
    assert f"-o backend.weights dense --llama-bench {path}" in result.output.splitlines()[0]
    cells = json.loads(out.read_text())["models"][str(tiny)]["cells"]
    assert [c["config"] for c in cells] == ["outrider", "llama-bench"]
    assert cells[1]["median"]["decode_tokens_per_s"] == pytest.approx(50.0)
    ours = cells[0]["runs"][0]["decode_tokens_per_s"]
    assert cells[0]["paired"]["vs_llama_bench"] == pytest.approx(ours / 50.0)
    assert "| vs llama-bench |" in result.output


def test_cli_bench_cost_curve_puts_llama_bench_beside_outrider(tiny, short_prompts, tmp_path):
    """With --cost-curve and a llama-bench, the peer's k-token forwards after the same 128-token prefix
    (`-p 1,...,16 -n 0 -d 128`) stand beside ours, as ratios and times: the fake's pass costs
    10 ms x (1 + (k - 1) / 10), so k = 16 is 2.5 steps and 25 ms."""
    path, log = _fake_llama_bench(tmp_path)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--models", str(tiny), "--tokens", "3", "--runs", "1",
                                       "--prompts", "story", "--temperatures", "0", "--drafters", "none",
                                       "--engines", "outrider,llama-bench", "--llama-bench", str(path), "--cost-curve",
                                       "--no-bandwidth", "--json-out", str(out), "--chart", ""])
    assert result.exit_code == 0, result.output
    calls = log.read_text().splitlines()
    ks = ",".join(str(k) for k in range(1, 17))
    assert f"-p {ks} -n 0 -d 128 -r 5 -o json" in calls[-1]
    entry = json.loads(out.read_text())["models"][str(tiny)]
    assert entry["peer_forward_cost_curve"]["llama-bench"]["16"] == pytest.approx(2.5)
    assert entry["peer_forward_ms"]["llama-bench"]["1"] == pytest.approx(10.0)
    assert entry["forward_cost_curve"]["1"] == 1.0 and len(entry["forward_ms"]) == 16
    assert "| llama-bench cost | 1.00 | 1.10 |" in result.output
    assert "| llama-bench ms | 10.00 | 11.00 |" in result.output
    assert "CPU vector extensions: " in result.output  # which kernels ran, beside the figures


def test_cli_bench_options_reach_every_outrider_configuration(tiny, short_prompts, tmp_path):
    result = CliRunner().invoke(main, ["bench", "--models", str(tiny), "--tokens", "3", "--runs", "1",
                                       "--prompts", "story", "--temperatures", "0", "--drafters", "none,lookup",
                                       "--engines", "outrider", "-o", "backend.weights", "sparse",
                                       "--no-bandwidth", "--json-out", str(tmp_path / "b.json"), "--chart", ""])
    for config in ("outrider", "outrider+lookup"):
        assert f"{config} skipped: ConfigError: unknown weights mode 'sparse'" in result.output, result.output


def test_the_report_shows_the_lengths_auto_chose_per_kind_of_draft():
    from outrider.bench.report import _lengths_by_kind

    cell = {"runs": [{"extra": {"chosen_draft_lengths_by_kind": {"lookup:4-gram": {"8": 2}, "mtp:mtp": {"2": 3}}}},
                     {"extra": {"chosen_draft_lengths_by_kind": {"lookup:4-gram": {"8": 1, "6": 1}}}}, {"extra": {}}]}
    assert _lengths_by_kind(cell) == {"lookup:4-gram": {"8": 3, "6": 1}, "mtp:mtp": {"2": 3}}
