"""The command line, end to end on tiny GGUF files: output shape, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from outrider.cli import main
from outrider.testing.tiny_models import write_tiny_gemma3, write_tiny_llama


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    mamba = folder / "mamba.gguf"
    w = gguf.GGUFWriter(str(mamba), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    llama = write_tiny_llama(folder / "llama.gguf")
    truncated = folder / "truncated.gguf"
    truncated.write_bytes(llama.read_bytes()[:5000])
    return {"llama": llama, "gemma3": write_tiny_gemma3(folder / "gemma3.gguf"), "mamba": mamba,
            "truncated": truncated, "folder": folder}


def invoke(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]


def test_generate_json_reports_tokens_text_and_stats(files):
    result = invoke("generate", "--model", files["llama"], "--json", "-n", "12", "--draft-max", "3",
                    "the the the the the the")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert len(out["tokens"]) == 12 and out["prompt_tokens"]
    stats = out["stats"]
    for key in ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "decode_tokens_per_s", "rounds",
                "drafted", "accepted", "acceptance_rate", "mean_acceptance_length", "per_position", "draft_s",
                "verify_s", "config"):
        assert key in stats
    assert stats["generated_tokens"] == 12
    assert stats["config"]["settings"]["drafter"] == {"value": "lookup", "source": "default"}
    assert stats["config"]["settings"]["draft_max"] == {"value": 3, "source": "flag"}


@pytest.mark.parametrize("sampling", [[], ["--temp", "0.8", "--seed", "5"]])
def test_several_prompts_run_as_one_batch_and_each_answer_is_its_own(files, tmp_path, sampling):
    """Repeated PROMPTs and a --prompts file (one a line) run as one batch; each prompt's tokens are what it gets
    alone (greedy, and seeded sampling)."""
    prompts = ["the the the the the the", "abc abc abc", "hello", "one two one two one two one"]
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(prompts[2:]) + "\n\n")
    common = ["--model", files["llama"], "--json", "-n", "16", "--draft-max", "4", *sampling]
    alone = []
    for prompt in prompts:
        result = invoke("generate", *common, prompt)
        assert result.exit_code == 0, result.output
        alone.append(json.loads(result.output.strip().splitlines()[-1])["tokens"])
    result = invoke("generate", *common, prompts[0], prompts[1], "--prompts", file)
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.output.strip().splitlines()]
    assert [a["index"] for a in answers] == [0, 1, 2, 3]
    assert [a["tokens"] for a in answers] == alone
    assert all(a["stats"]["generated_tokens"] == 16 for a in answers)
    text = invoke("generate", "--model", files["llama"], "-n", "4", "a b", "c d")
    assert text.exit_code == 0 and "==> 1/2 <==" in text.output and "==> 2/2 <==" in text.output, text.output


def test_no_prompt_at_all_is_a_usage_error(files, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    result = invoke("generate", "--model", files["llama"], "--prompts", empty)
    assert result.exit_code == 2 and "give a PROMPT" in result.output, result.output


def test_generate_takes_draft_max_auto_and_rejects_a_bad_one(files):
    result = invoke("generate", "--model", files["llama"], "--json", "-n", "6", "--draft-max", "auto", "the the the")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output.strip().splitlines()[-1])["stats"]
    assert stats["config"]["settings"]["draft_max"] == {"value": "auto", "source": "flag"}
    assert "chosen_draft_lengths" in stats
    assert_one_line_error(invoke("generate", "--model", files["llama"], "--draft-max", "many", "hi"),
                          "draft_max from flag must be a number >= 0 or auto")


def test_generate_streams_text_and_reads_stdin(files):
    plain = invoke("generate", "--model", files["gemma3"], "--drafter", "none", "-n", "8", "-", input="the heat")
    assert plain.exit_code == 0, plain.output
    as_json = invoke("generate", "--model", files["gemma3"], "--drafter", "none", "-n", "8", "--json", "the heat")
    assert plain.output.rstrip("\n") == json.loads(as_json.output)["text"].rstrip("\n")


@pytest.mark.parametrize("case, fragments", [
    ("missing", ["no such model file"]),
    ("truncated", ["truncated"]),
    ("mamba", ["unknown architecture 'mamba'"]),
    ("catalog", ["unknown model 'smollm9'"]),
])
def test_bad_model_files_are_one_line_errors(files, case, fragments):
    model = {"missing": files["folder"] / "absent.gguf", "truncated": files["truncated"], "mamba": files["mamba"],
             "catalog": "smollm9"}[case]
    assert_one_line_error(invoke("generate", "--model", model, "hi"), *fragments)


def test_bad_settings_are_one_line_errors(files, tmp_path):
    config_file = tmp_path / "c.toml"
    config_file.write_text("drafterr = 'lookup'\n")
    assert_one_line_error(invoke("generate", "--model", files["llama"], "--config", config_file, "hi"),
                          "unknown key 'drafterr'")
    assert_one_line_error(invoke("generate", "--model", files["llama"], "--drafter", "eagle", "hi"),
                          "unknown drafter 'eagle'")
    assert_one_line_error(invoke("generate", "--model", files["llama"], "-o", "drafter.nope", "1", "hi"),
                          "unknown option 'nope'", "max_n, min_n")
    assert_one_line_error(invoke("generate", "--model", files["llama"], "--drafter", "draft-model",
                                 "--draft-model", files["gemma3"], "hi"), "same tokenizer")
    assert_one_line_error(invoke("generate", "--model", files["llama"], "--context", "8", "x " * 40),
                          "shorten the prompt")
    for count in ("-5", "0"):  # the runner always yields the prefill's token: fewer than one cannot be honoured
        assert_one_line_error(invoke("generate", "--model", files["llama"], "--max-tokens", count, "hi"),
                              f"max_tokens from flag must be at least 1 (most tokens to generate), got {count}")


def test_sigint_keeps_the_streamed_text_and_exits_130(tmp_path):
    # seed 1 on this prompt decodes greedily past 4000 tokens without an end-of-generation token, so the
    # signal lands mid-generation however slow the machine is
    model = write_tiny_llama(tmp_path / "long.gguf", seed=1, context=8192)
    process = subprocess.Popen([sys.executable, "-m", "outrider", "generate", "--model", str(model), "--context",
                                "8192", "-n", "4000", "--drafter", "none", "the the the"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "OUTRIDER_NATIVE": "0"})
    streamed = b""
    while len(streamed) < 64:
        chunk = os.read(process.stdout.fileno(), 4096)
        if not chunk:
            break
        streamed += chunk
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=120)
    if process.returncode == 0 and len(streamed + rest) >= 4000:
        # on a starved machine this process may not run again until the child has written all 4000 tokens
        pytest.skip("the generation finished before the signal was sent")
    assert process.returncode == 130, err.decode()
    assert len(streamed) >= 64 and len(streamed + rest) < 4000  # printed as it came, and cut short
    assert err.decode().strip().splitlines()[-1] == "interrupted" and b"Traceback" not in err


def test_interrupted_json_holds_the_tokens_so_far(files, monkeypatch):
    from outrider.spec.runner import Runner

    args = ["generate", "--model", files["llama"], "--drafter", "none", "-n", "12", "--json", "the the the"]
    whole = json.loads(invoke(*args).output.strip().splitlines()[-1])
    real_generate = Runner.generate

    def interrupted_after_five(self, *a, **k):  # what a Ctrl-C after the fifth token does to the loop
        for i, token in enumerate(real_generate(self, *a, **k)):
            if i == 5:
                raise KeyboardInterrupt
            yield token

    monkeypatch.setattr(Runner, "generate", interrupted_after_five)
    result = invoke(*args)
    assert result.exit_code == 130
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1] == "interrupted"
    cut = json.loads(lines[-2])
    assert cut["tokens"] == whole["tokens"][:5] and cut["stats"]["stop_reason"] == "interrupted"


def test_lossy_acceptor_prints_a_warning(files):
    result = invoke("generate", "--model", files["llama"], "--acceptor", "p-min", "-n", "4", "hello")
    assert result.exit_code == 0
    assert "warning:" in result.output and "lossy" in result.output


def test_plugins_and_models_listings():
    result = invoke("plugins", "--json")
    assert result.exit_code == 0
    rows = json.loads(result.output)
    assert {(r["kind"], r["name"]) for r in rows} >= {("backend", "cpu"), ("drafter", "lookup"), ("acceptor", "greedy")}
    assert all(r["package"] for r in rows)
    models = invoke("models")
    assert models.exit_code == 0 and "smollm2-135m (default)" in models.output and "gemma3-270m" in models.output


def test_llama_cpp_flags_mean_what_they_mean_there(files):
    result = invoke("generate", "--model", files["llama"], "--json", "-n", "4", "-t", "1", "-c", "96", "--temp",
                    "0.7", "--seed", "3", "-md", files["llama"], "-d", "draft-model", "the the the")
    assert result.exit_code == 0, result.output
    config = json.loads(result.output.strip().splitlines()[-1])["stats"]["config"]
    assert config["settings"]["context"]["value"] == 96 and config["settings"]["temperature"]["value"] == 0.7
    assert config["settings"]["draft_model"]["value"] == str(files["llama"])
    assert config["options"]["backend"]["threads"]["value"] in (1, "1"), config["options"]
    long = invoke("generate", "--model", files["llama"], "--json", "-n", "2", "--threads", "1", "--ctx-size", "96",
                  "the")
    assert long.exit_code == 0, long.output


def test_a_temperature_given_to_t_gets_a_hint():
    result = invoke("generate", "-t", "0.7", "hi")
    assert result.exit_code == 2 and "--temp 0.7" in result.output and "threads" in result.output, result.output


def test_t_on_another_backend_sets_the_process_threads(monkeypatch):
    import torch

    from outrider.cli import with_threads

    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    assert with_threads([], 3, "cuda") == [] and set_to == [3]  # cuda has no threads option to pass it to
    assert with_threads([], 3, None) == [("backend.threads", "3")] and with_threads([], 3, "cpu")[0][1] == "3"
    assert with_threads([("backend.threads", "1")], 3, None) == [("backend.threads", "1")]


def test_generate_takes_llama_cpp_sampling_flags_and_refuses_bad_values(files):
    flags = ("--temp", "0", "--min-p", "0.05", "--repeat-penalty", "1.1", "--presence-penalty", "0.5",
             "--frequency-penalty", "0.2", "--repeat-last-n", "-1")
    result = invoke("generate", "--model", files["llama"], "--json", "-n", "4", *flags, "the the the")
    assert result.exit_code == 0, result.output
    settings = json.loads(result.output.strip().splitlines()[-1])["stats"]["config"]["settings"]
    assert {k: settings[k]["value"] for k in ("min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
                                              "repeat_last_n")} == \
        {"min_p": 0.05, "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.2, "repeat_last_n": -1}
    for flag, value, message in [("--min-p", "1.5", "min_p must be in [0, 1]"),
                                 ("--repeat-penalty", "0", "repeat_penalty must be a finite number > 0"),
                                 ("--repeat-last-n", "-2", "repeat_last_n must be an integer >= -1")]:
        assert_one_line_error(invoke("generate", "--model", files["llama"], flag, value, "hi"), message)
