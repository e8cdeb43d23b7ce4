"""The `outrider` command line."""

from __future__ import annotations

import functools
import json
import sys
import time

import click

from outrider.errors import OutriderError
from outrider.hookspecs import PLUGIN_KINDS


def friendly_errors(fn):
    """Turn user-fixable errors into one line on stderr and exit status 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OutriderError as exc:
            sys.stdout.flush()
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            sys.stdout.flush()
            click.echo("\ninterrupted", err=True)
            sys.exit(130)

    return wrapper


class OutriderGroup(click.Group):
    """The command group; third-party plugins may add commands through the `register_commands` hook."""

    def _ensure_plugin_commands(self):
        if getattr(self, "_plugins_loaded", False):
            return
        self._plugins_loaded = True
        try:
            from outrider.registry import default_registry
            default_registry().manager.hook.register_commands(cli=self)
        except Exception as exc:  # a third-party command that fails to register must not take the CLI down
            click.echo(f"warning: a plugin's register_commands failed ({type(exc).__name__}: {exc})", err=True)

    def list_commands(self, ctx):
        self._ensure_plugin_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx, name):
        command = super().get_command(ctx, name)
        if command is None:
            self._ensure_plugin_commands()
            command = super().get_command(ctx, name)
        return command


class ThreadCount(click.ParamType):
    """-t is llama.cpp's thread count; it was Outrider's temperature, so a number with a point gets a hint."""

    name = "N"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            count = int(value)
        except ValueError:
            hint = f" (for a temperature of {value} use --temp {value})" if _is_number(value) else ""
            self.fail(f"-t/--threads takes a whole number of threads, as in llama.cpp{hint}", param, ctx)
        if count < 1:
            self.fail(f"-t/--threads must be at least 1 (got {count}); leave it out for the backend's default",
                      param, ctx)
        return count


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def with_threads(options, threads: int | None, backend: str | None = None) -> list[tuple[str, str]]:
    """The -o options, with -t N as `backend.threads N` unless -o gave that already (the later flag wins in
    llama.cpp; here the explicit option does). Another backend than the CPU's has no such option: there -t sets
    the process's CPU threads, as llama.cpp's -t does beside a GPU."""
    options = list(options)
    if threads is None or any(key in ("backend.threads", "threads") for key, _ in options):
        return options
    if backend not in (None, "cpu"):
        import torch

        torch.set_num_threads(threads)
        return options
    options.append(("backend.threads", str(threads)))
    return options


@click.group(cls=OutriderGroup)
@click.version_option(package_name="outrider")
def main():
    """Outrider: speculative decoding for GGUF language models, assembled from plugins."""


def _read_prompt(prompt: str) -> str:
    return sys.stdin.read() if prompt == "-" else prompt


@main.command()
@click.argument("prompts", nargs=-1)
@click.option("--prompts", "prompts_file", type=click.File("r"), help="A file of prompts, one per line (`-`: stdin); "
              "with it, or several PROMPTs, they run as one batch and each answer is printed after a `==> i/n <==` "
              "line (one JSON object per line with --json).")
@click.option("--model", "-m", help="Target model: catalog name (see `outrider models`) or .gguf path.")
@click.option("--max-tokens", "-n", type=int, help="Most tokens to generate [128; served requests that leave it out get the rest of the context unless this is given].")
@click.option("--temperature", "--temp", type=float, help="Sampling temperature; 0 = greedy [0].")
@click.option("--threads", "-t", type=ThreadCount(), help="CPU threads (as llama.cpp's -t); the same as "
              "`-o backend.threads N` [the backend's default].")
@click.option("--top-k", type=int, help="Keep the k most likely tokens; 0 = off [0].")
@click.option("--top-p", type=float, help="Nucleus sampling mass; 1 = off [1].")
@click.option("--min-p", type=float, help="Keep tokens whose probability is at least this times the most probable "
              "one's (after temperature, as transformers and vLLM measure it; llama.cpp measures before it); 0 = off [0].")
@click.option("--repeat-penalty", type=float, help="Penalise tokens among the last --repeat-last-n: a positive logit "
              "is divided by this, a negative one multiplied; 1 = off [1].")
@click.option("--presence-penalty", type=float, help="Subtract this from the logit of a token among the last "
              "--repeat-last-n; 0 = off [0].")
@click.option("--frequency-penalty", type=float, help="Subtract this times a token's count among the last "
              "--repeat-last-n from its logit; 0 = off [0].")
@click.option("--repeat-last-n", type=int, help="How many of the context's last tokens the penalties count; "
              "-1 = the whole context, 0 = off [64].")
@click.option("--seed", type=int, help="Random seed [random].")
@click.option("--chat/--no-chat", default=None, help="Apply the model's chat template to the prompt.")
@click.option("--drafter", "-d", help="Drafter plugin [lookup]; `none` for plain decoding; `lookup,mtp` combines "
              "drafters (the first with a draft drafts each round).")
@click.option("--acceptor", "-a", help="Acceptor plugin [auto: greedy at T=0, sampled above].")
@click.option("--backend", "-b", help="Backend plugin [cpu].")
@click.option("--draft-model", "-md", help="Draft model for the draft-model drafter: catalog name or .gguf path.")
@click.option("--draft-max", help="Tokens drafted per round: a number, or auto (chosen each round) [auto].")
@click.option("--draft-min", type=int, help="Drop proposals shorter than this, except drafts sampled from q, "
                                            "whose length depends on their tokens (dropping them would bias the output) [0].")
@click.option("--draft-p-min", type=float, help="Drafter-side stop: end the draft at a position where the drafter's "
                                                "largest probability is below this, decided before its token is drawn [0].")
@click.option("--context", "--ctx-size", "-c", type=int, help="KV cache length in tokens [4096].")
@click.option("-o", "--option", "options", type=(str, str), multiple=True, metavar="KEY VALUE",
              help="Plugin option, e.g. `-o drafter.max_n 5` or `-o p_min 0.2`.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--verbose", "-v", is_flag=True, help="Print a one-line summary to stderr.")
@friendly_errors
def generate(prompts, prompts_file, options, config_file, as_json, verbose, **flags):
    """Generate text for PROMPT (`-` reads it from stdin); several PROMPTs (or --prompts FILE) run as one batch."""
    from outrider.assembly import assemble
    from outrider.config import resolve_config
    from outrider.io.chat import prompt_ids as chat_prompt_ids

    texts = [_read_prompt(p) for p in prompts]
    if prompts_file is not None:
        texts += [line.rstrip("\r\n") for line in prompts_file if line.strip()]
    if not texts:
        raise click.UsageError("give a PROMPT (or several), `-` to read one from stdin, or --prompts FILE")
    config = resolve_config(flags, config_file, option_flags=with_threads(options, flags.pop("threads"), flags.get("backend")))
    load_start = time.perf_counter()
    assembly = assemble(config)
    load_s = time.perf_counter() - load_start
    for warning in assembly.warnings:
        click.echo(f"warning: {warning}", err=True)
    tokenizer = assembly.tokenizer
    if len(texts) > 1:
        ids = [chat_prompt_ids(assembly.gguf, tokenizer, text, chat=config["chat"]) for text in texts]
        return _generate_batch(assembly, config, ids, load_s, as_json, verbose)
    prompt_ids = chat_prompt_ids(assembly.gguf, tokenizer, texts[0], chat=config["chat"])

    runner = assembly.runner
    decoder = tokenizer.stream_decoder()
    generated, pieces = [], []
    interrupted = False
    try:
        for token in runner.generate(prompt_ids, config["max_tokens"], assembly.params, tokenizer.eog_ids):
            generated.append(token)
            if token in tokenizer.eog_ids:
                continue
            piece = decoder.push(token)
            pieces.append(piece)
            if not as_json and piece:
                click.echo(piece, nl=False)
                sys.stdout.flush()
    except KeyboardInterrupt:  # what was generated is still the answer so far: print it, then exit 130
        interrupted = True
        runner.stats.stop_reason = "interrupted"
    finally:
        tail = decoder.flush()
        pieces.append(tail)
        if not as_json:
            click.echo(tail)
    stats = _report(assembly, config, runner.stats, load_s)
    if as_json:
        click.echo(json.dumps({"text": "".join(pieces), "tokens": generated, "prompt_tokens": prompt_ids,
                               "stats": stats}, ensure_ascii=False))
    if verbose:
        click.echo(_summary(stats), err=True)
    if interrupted:
        raise KeyboardInterrupt  # friendly_errors: "interrupted" on stderr, exit status 130


def _report(assembly, config, generation_stats, load_s: float) -> dict:
    """A generation's stats as --json and --verbose show them, with the settings and plugins that made it."""
    runner, specs = assembly.runner, assembly.plugins
    stats = generation_stats.as_dict()
    stats["load_s"] = round(load_s, 3)
    stats["config"] = config.report(assembly.options)
    stats["plugins"] = {kind: spec.name for kind, spec in specs.items()}
    stats["capabilities"] = {"backend": _plain(instance_capabilities(specs["backend"], runner.target.backend)),
                             "drafter": _plain(runner.traits.capabilities),
                             "acceptor": _plain(instance_capabilities(specs["acceptor"], runner.acceptor))}
    return stats


def _generate_batch(assembly, config, prompt_ids: list[list[int]], load_s: float, as_json: bool, verbose: bool) -> None:
    """Several prompts as one batch (the offline job of vLLM's `LLM.generate`): every running sequence stepped
    together, one ragged verify forward a round, each answer what it would be alone. Printed in order once all are
    done: a `==> i/n <==` line and the text, or one JSON object a line."""
    from outrider.errors import OutriderError

    runner, tokenizer = assembly.runner, assembly.tokenizer
    if not getattr(runner.target.model, "batches", True):
        raise OutriderError(f"a {assembly.gguf.architecture} model runs one sequence at a time; give one prompt")
    started = time.perf_counter()
    seqs = runner.generate_many(prompt_ids, config["max_tokens"], [assembly.params] * len(prompt_ids),
                                tokenizer.eog_ids)
    wall_s = time.perf_counter() - started
    for i, seq in enumerate(seqs):
        decoder = tokenizer.stream_decoder()
        text = "".join(decoder.push(t) for t in seq.output if t not in tokenizer.eog_ids) + decoder.flush()
        if as_json:
            click.echo(json.dumps({"index": i, "text": text, "tokens": seq.output, "prompt_tokens": seq.prompt,
                                   "stats": _report(assembly, config, seq.stats, load_s)}, ensure_ascii=False))
        else:
            click.echo(f"==> {i + 1}/{len(seqs)} <==\n{text}")
        if verbose:
            click.echo(f"[{i + 1}/{len(seqs)}] " + _summary(_report(assembly, config, seq.stats, load_s)), err=True)
    if verbose:
        total = sum(seq.stats.generated_tokens for seq in seqs)
        click.echo(f"batch of {len(seqs)}: {total} tokens in {wall_s:.2f}s, {total / wall_s:.1f} tok/s over all "
                   "sequences (prefills included)", err=True)


# generate's settings that a server has no use for: the prompt comes with each request, and each endpoint
# decides whether the chat template applies
_NOT_SERVED = {"prompts", "prompts_file", "chat", "as_json", "verbose"}


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True, help="Port to listen on.")
@click.option("--parallel", "-np", type=int, default=None,
              help="Generations run at once (llama-server's -np): each round every running one drafts and one "
                   "forward verifies them all. A -c given is the total, split across them; without -c each keeps "
                   "the whole default context. [default: 4, fewer where memory is short; 1 for a model or backend "
                   "that runs one sequence at a time]")
@click.option("--queue-size", type=click.IntRange(min=0), default=16, show_default=True,
              help="Requests that may wait while every slot generates; more are answered 503 with Retry-After.")
@click.option("--api-key", "api_key", multiple=True, envvar="OUTRIDER_API_KEY",
              help="Require `Authorization: Bearer KEY` on every /v1 route and /tokenize, /detokenize, /props (repeat for several keys; also "
                   "$OUTRIDER_API_KEY, keys separated by spaces). /health and /metrics stay open, as vLLM's do.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
              help="Read API keys from this file, one a line (blank lines and # comments skipped).")
@click.option("--stall-timeout", type=click.FloatRange(min=0), default=None,
              help="Fail a generation that makes no progress for this many seconds (a stuck plugin): its client "
                   "gets a 503, /health answers 503 until it returns, waiting requests get 503 with Retry-After. "
                   "0: off. [default: max(120, context / 10): a whole-context prefill at 10 tokens/s]")
@click.option("--request-timeout", type=click.FloatRange(min=0), default=0, show_default=True,
              help="End a request after this many seconds with its text so far, finish_reason \"length\" and "
                   "stop_reason \"timeout\". "
                   "0: off.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=None,
              help="Answer a request body larger than this 413, before reading it whole. [default: 4 MiB]")
@click.option("--max-connections", type=click.IntRange(min=1), default=None,
              help="Open connections at most, idle keep-alives and probes included; more are answered 503 at once. "
                   "[default: 64]")
@click.option("--allow-special-in-messages", is_flag=True, default=False,
              help="Encode a control token's text inside a chat message (`<|im_start|>`) as that token, as "
                   "llama-server does; by default it is plain text, so a client cannot write another role's turn.")
@friendly_errors
def serve(host, port, parallel, queue_size, api_key, api_key_file, stall_timeout, request_timeout, max_body_bytes,
          max_connections, allow_special_in_messages, options, config_file, **flags):
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models), llama-server's /tokenize,
    /detokenize and /props, /health and /metrics.

    Takes every setting `generate` takes; the model is assembled once. Sampling settings given here are
    the defaults for requests that leave them out."""
    from outrider.assembly import assemble
    from outrider.config import resolve_config
    from outrider.serve import create_app, run_server
    from outrider.serve.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS
    from outrider.serve.engine import on_a_passing_thread
    from outrider.serve.slots import plan_slots

    keys = api_keys(api_key, api_key_file)
    config = resolve_config(flags, config_file, option_flags=with_threads(options, flags.pop("threads"), flags.get("backend")))

    def load():
        assembly = assemble(config)
        runner = assembly.runner
        plan = plan_slots(runner.target.model, assembly.plugins["backend"].name, runner.context,
                          config.sources.get("context", "default") != "default", parallel)
        runner.set_slots(plan.slots, plan.context)
        return assembly, plan

    assembly, plan = on_a_passing_thread(load)  # the generation thread's kernels then have the cores to themselves
    for warning in assembly.warnings:
        click.echo(f"warning: {warning}", err=True)
    if plan.note:
        click.echo(f"note: {plan.note}", err=True)
    if not keys and not is_loopback(host):
        click.echo(f"warning: serving on {host} without an API key: anyone who can reach the port can use it; "
                   "pass --api-key or --api-key-file", err=True)
    app = create_app(assembly, config, queue_size=queue_size, api_keys=keys, stall_timeout=stall_timeout,
                     request_timeout=request_timeout, max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                     special_in_messages=allow_special_in_messages, slots=plan.slots)
    click.echo(f"serving {app.state.server.model_id} ({', '.join(f'{k} {s.name}' for k, s in assembly.plugins.items())}) "
               f"on http://{host}:{port}/v1, {plan.slots} slot{'s' if plan.slots > 1 else ''} of {plan.context} tokens "
               f"({plan.cache_bytes / 2**20:.0f} MiB of KV cache)", err=True)
    run_server(app, host, port, max_connections=max_connections or DEFAULT_MAX_CONNECTIONS)


serve.params.extend(p for p in generate.params if p.name not in _NOT_SERVED)


def api_keys(given: tuple[str, ...], key_file: str | None) -> list[str]:
    """The keys of --api-key / $OUTRIDER_API_KEY and of --api-key-file (one a line); never echoed anywhere. An
    empty key is refused: `--api-key "$UNSET_VARIABLE"` must not start a server open to all."""
    import os
    from pathlib import Path

    from outrider.errors import ConfigError

    env = os.environ.get("OUTRIDER_API_KEY")
    if any(not key.strip() for key in given) or (not given and not key_file and env is not None and not env.strip()):
        raise ConfigError("the API key given (--api-key or $OUTRIDER_API_KEY) is empty: give the key, or leave "
                          "both out (and unset the variable) for a server without one")
    keys = [key.strip() for key in given]
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read --api-key-file {key_file}: {exc.strerror}; give a readable file "
                              "with one key a line") from None
        keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise ConfigError(f"--api-key-file {key_file} holds no key; write one key a line")
    return keys


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _summary(stats: dict) -> str:
    line = (f"{stats['plugins']['drafter']}+{stats['plugins']['acceptor']}: {stats['generated_tokens']} tokens, "
            f"{stats['decode_tokens_per_s']:.1f} tok/s decode, prefill {stats['prompt_tokens']} tokens in "
            f"{stats['prefill_s']:.2f}s")
    if stats["drafted"]:
        line += (f", {stats['rounds']} rounds, accepted {stats['accepted']}/{stats['drafted']} "
                 f"({stats['acceptance_rate']:.0%}), mean acceptance length {stats['mean_acceptance_length']:.2f}")
    return line


@main.group(invoke_without_command=True)
@click.pass_context
def models(ctx):
    """List the model catalog and what is cached; `outrider models pull NAME` fetches one."""
    if ctx.invoked_subcommand is not None:
        return
    from outrider.catalog import CATALOG, DEFAULT_MODEL, cached_path, is_cached
    from outrider.paths import outrider_home

    click.echo(f"cache: {outrider_home() / 'models'}")
    for entry in CATALOG.values():
        state = f"cached at {cached_path(entry)}" if is_cached(entry) else "not cached (outrider models pull NAME)"
        default = " (default)" if entry.name == DEFAULT_MODEL else ""
        click.echo(f"{entry.name}{default}: {entry.architecture} {entry.quantization}, "
                   f"{entry.size / 1e6:.0f} MB, {state}\n    {entry.description}")


@models.command("pull")
@click.argument("name")
@friendly_errors
def models_pull(name):
    """Fetch catalog model NAME into the cache (once; sha256-checked)."""
    from outrider.catalog import CATALOG, ensure_model
    from outrider.errors import ModelFileError

    if name not in CATALOG:
        raise ModelFileError(f"unknown model '{name}'; the catalog has: {', '.join(CATALOG)}")
    path = ensure_model(name)
    click.echo(str(path))


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _split(values: tuple[str, ...]) -> list[str]:
    """Options that take a list accept repetition and commas alike: `--models a,b` or `--models a --models b`."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


@main.command()
@click.option("--models", multiple=True, help="Catalog names or .gguf paths [smollm2-135m,gemma3-270m].")
@click.option("--tokens", "-n", type=int, default=128, show_default=True, help="New tokens per run.")
@click.option("--runs", type=int, default=3, show_default=True, help="Measured rounds (after one warm-up round).")
@click.option("--threads", type=int, default=0, help="Threads for every engine [torch's default].")
@click.option("--prompts", multiple=True, help="Any of code, summary, story [all].")
@click.option("--temperatures", multiple=True,
              help="Comma-separated; T@p adds top-p p (0.7@0.95 is what chat front-ends send) [0,0.7,0.7@0.95].")
@click.option("--engines", multiple=True, help="Any of outrider, llama.cpp, llama-bench, transformers [all installed or given].")
@click.option("--drafters", multiple=True, help="Outrider drafters: none, lookup, draft-model, mtp, and "
              "combinations joined with + (lookup+mtp) [all].")
@click.option("--draft-max", default="auto", show_default=True, help="Outrider draft length: a number or auto.")
@click.option("--seed", type=int, default=1, show_default=True, help="Seed of the first measured round.")
@click.option("--chat/--no-chat", default=True, show_default=True,
              help="Apply the model's chat template (raw text when the file has none).")
@click.option("--bandwidth/--no-bandwidth", default=True, show_default=True,
              help="Measure DRAM read bandwidth and print the bound it puts on decode speed.")
@click.option("--cost-curve", is_flag=True,
              help="Also print the k-token forward cost curve (k = 1..16) and its times: Outrider's, and "
                   "llama-bench's when it is an engine.")
@click.option("-o", "--option", "options", type=(str, str), multiple=True, metavar="KEY VALUE",
              help="Plugin option for every Outrider configuration, e.g. `-o backend.activations float32`.")
@click.option("--llama-bench", "llama_bench", default="", envvar="LLAMA_BENCH", type=click.Path(dir_okay=False),
              help="llama.cpp's llama-bench binary, run as the engine llama-bench beside llama-cpp-python "
                   "[$LLAMA_BENCH; skipped without one].")
@click.option("--json-out", default="bench.json", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write every run and the medians.")
@click.option("--chart", default="bench.png", show_default=True, type=click.Path(dir_okay=False),
              help="Where to draw the PNG chart ('' for none).")
@friendly_errors
def bench(models, tokens, runs, threads, prompts, temperatures, engines, drafters, draft_max, seed, chat,
          bandwidth, cost_curve, options, llama_bench, json_out, chart):
    """Outrider plain and with each drafter beside llama.cpp and transformers (plain and prompt lookup), on
    the same files, threads and prompt tokens; prints a markdown table, writes JSON and a PNG chart.
    Peers are optional (`pip install 'outrider[bench]'`, llama-cpp-python built by scripts/install-peers)."""
    import shlex

    from outrider import bench as harness
    from outrider.config import parse_draft_max
    from outrider.errors import ConfigError

    samplings = [harness.Sampling.parse(spec) for spec in _split(temperatures)] or list(harness.DEFAULT_SAMPLINGS)
    try:
        draft_length = parse_draft_max(draft_max)
    except ValueError:
        raise ConfigError("--draft-max takes a number >= 0 or auto") from None
    settings = harness.BenchSettings(
        models=_split(models) or list(harness.DEFAULT_MODELS), tokens=tokens, runs=runs, threads=threads,
        prompts=_split(prompts) or list(harness.PROMPTS), samplings=samplings,
        engines=_split(engines) or list(harness.ENGINES), drafters=_split(drafters) or list(harness.DRAFTERS),
        chat=chat, seed=seed, draft_max=draft_length, bandwidth=bandwidth, cost_curve=cost_curve,
        options=list(options), llama_bench=llama_bench)
    settings.check()
    # rebuilt from the parsed settings, so the committed table says exactly what produced it
    command = shlex.join([
        "outrider", "bench", "--models", ",".join(settings.models), "--tokens", str(tokens), "--runs", str(runs),
        "--threads", str(threads or _torch_threads()), "--prompts", ",".join(settings.prompts),
        "--temperatures", ",".join(str(s) for s in samplings), "--engines", ",".join(settings.engines),
        "--drafters", ",".join(settings.drafters), "--draft-max", str(draft_length), "--seed", str(seed),
        "--chat" if chat else "--no-chat", *([] if bandwidth else ["--no-bandwidth"]),
        *(["--cost-curve"] if cost_curve else []), *[part for pair in options for part in ("-o", *pair)],
        *(["--llama-bench", llama_bench] if llama_bench else []),
        "--json-out", json_out, "--chart", chart])
    click.echo(f"`{command}`\n")
    report = harness.run_bench(settings, echo=lambda line: click.echo(line, err=True))
    report["command"] = command
    click.echo(harness.markdown(report))
    harness.write_json(report, json_out)
    click.echo(f"wrote {json_out}", err=True)
    if chart:
        if harness.draw_chart(report, chart):
            click.echo(f"wrote {chart}", err=True)
        else:
            click.echo("note: no chart: matplotlib is not installed (pip install 'outrider[bench]')", err=True)


@main.command()
@click.argument("model")
@click.argument("text_file", metavar="FILE", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--ctx-size", "-c", "n_ctx", type=click.IntRange(min=4), default=512, show_default=True,
              help="Tokens per chunk; the second half of each is scored (llama-perplexity's -c).")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Score at most this many chunks [all].")
@click.option("--backend", "-b", help="Backend plugin [cpu].")
@click.option("--threads", "-t", type=ThreadCount(), help="CPU threads (as llama.cpp's -t).")
@click.option("-o", "--option", "options", type=(str, str), multiple=True, metavar="KEY VALUE",
              help="Plugin option, e.g. `-o backend.activations float32`.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML settings file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@friendly_errors
def perplexity(model, text_file, n_ctx, chunks, backend, threads, options, config_file, as_json):
    """Perplexity of MODEL (catalog name or .gguf path) over the text in FILE (`-` reads stdin), measured as
    llama-perplexity measures it, so the two compare on one file and text."""
    from outrider.assembly import assemble
    from outrider.config import resolve_config
    from outrider.errors import ConfigError
    from outrider.perplexity import perplexity as measure

    try:
        if text_file == "-":
            text = sys.stdin.read()
        else:
            with open(text_file, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {text_file}: {e}; give a UTF-8 text file") from None
    flags = {"model": model, "backend": backend, "drafter": "none", "context": n_ctx}
    config = resolve_config(flags, config_file, option_flags=with_threads(options, threads, backend))
    assembly = assemble(config)
    for warning in assembly.warnings:
        click.echo(f"warning: {warning}", err=True)

    def progress(done, total, estimate):
        if not as_json:
            click.echo(f"[{done}]{estimate:.4f},", nl=done == total)
            sys.stdout.flush()

    result = measure(assembly.runner.target.model, assembly.tokenizer, text, n_ctx=n_ctx, max_chunks=chunks,
                     on_chunk=progress)
    if as_json:
        click.echo(json.dumps({"model": model, "file": text_file, **result.as_dict(),
                               "options": assembly.options["backend"]}))
        return
    click.echo(f"Final estimate: PPL = {result.perplexity:.4f} +/- {result.uncertainty:.5f} "
               f"({result.tokens_scored} tokens in {result.chunks} chunks of {n_ctx}, {result.seconds:.1f} s)")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@friendly_errors
def plugins(as_json):
    """List every installed plugin: kind, name, aliases, capabilities, options, providing package."""
    from outrider.config import SETTINGS
    from outrider.registry import default_registry

    rows = []
    for spec in default_registry().all():
        rows.append({
            "kind": spec.kind, "name": spec.name, "aliases": list(spec.aliases), "package": spec.package,
            "default": SETTINGS[spec.kind].default == spec.name,
            "capabilities": _plain(instance_capabilities(spec)),
            "options": {o.name: {"type": o.type.__name__, "default": o.default, "help": o.help}
                        for o in spec.options.values()},
        })
        if spec.kind == "acceptor" and spec.name == "sampled":  # `auto` is a choice between two, not a plugin
            rows.append({"kind": "acceptor", "name": "auto", "aliases": [], "package": spec.package,
                         "default": SETTINGS["acceptor"].default == "auto",
                         "chooses": "greedy at temperature 0, sampled above", "capabilities": {}, "options": {}})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        aliases = f" (aliases: {', '.join(row['aliases'])})" if row["aliases"] else ""
        default = " (default)" if row["default"] else ""
        chooses = f": {row['chooses']}" if "chooses" in row else ""
        caps = ", ".join(f"{k}={v}" for k, v in row["capabilities"].items())
        click.echo(f"{row['kind']:9} {row['name']}{aliases}{default}{chooses}  [{row['package']}]")
        if caps:
            click.echo(f"          capabilities: {caps}")
        for name, opt in row["options"].items():
            click.echo(f"          -o {row['kind']}.{name} ({opt['type']}, default {opt['default']!r}): {opt['help']}")


def _plain(capabilities: dict) -> dict:
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in capabilities.items()}


def instance_capabilities(spec, instance=None) -> dict:
    """Capabilities as an instance has them (an option may switch one): `instance`, or one made with the default
    options; the registered ones where no instance can be made (a missing GPU, a required option), or for what
    the instance does not say."""
    from outrider.registry import as_the_instance_has_them

    if instance is None:
        try:
            instance = spec.create()
        except Exception:
            instance = None
    return as_the_instance_has_them(spec.capabilities, instance)


@main.command()
@click.argument("name")
@click.option("--kind", "-k", type=click.Choice(PLUGIN_KINDS),
              help="Which kind NAME is, when more than one kind has a plugin of that name [all of them].")
@click.option("-o", "--option", "options", type=(str, str), multiple=True, metavar="KEY VALUE",
              help="Create the plugin with this option, e.g. `-o max_depth 16`.")
@friendly_errors
def check(name, kind, options):
    """Run the plugin contract suite against plugin NAME and print a report; exit 1 if a check fails."""
    import tempfile

    from outrider.testing.fixtures import ContractFixtures
    from outrider.testing.report import find_specs, format_report, run_contract, subject_for

    specs = find_specs(name, kind)
    _build_kernels_first()
    failed = False
    with tempfile.TemporaryDirectory(prefix="outrider-check-") as folder:
        fixtures = ContractFixtures(folder)
        for i, spec in enumerate(specs):
            results = run_contract(subject_for(spec, fixtures, dict(options)))
            click.echo(("\n" if i else "") + format_report(spec, results))
            failed = failed or any(r.status == "FAIL" for r in results)
    if failed:
        sys.exit(1)


def _build_kernels_first() -> None:
    """The fixtures run on the CPU backend, whose kernels are compiled on a machine's first use: build them
    before the first check (the builder says so on stderr), so the build is not reported as a check's time."""
    from outrider.native import NativeUnavailable, load

    start = time.perf_counter()
    try:
        load()
    except NativeUnavailable:
        return  # the CPU backend falls back to torch's ops; the checks say what they find
    if time.perf_counter() - start > 1.0:
        click.echo(f"outrider: CPU kernels ready after {time.perf_counter() - start:.0f}s; the checks' times below "
                   "do not include the build", err=True)


if __name__ == "__main__":
    main()
