"""`outrider distill`: the command the mtp package adds to the CLI (through `register_commands`)."""

from __future__ import annotations

import click

from outrider.cli import friendly_errors


@click.command()
@click.argument("model")
@click.option("--minutes", type=float, default=30.0, show_default=True, help="Wall-clock budget for the whole run.")
@click.option("--steps", type=int, default=0,
              help="Train this many steps in all (a resumed run included) instead of until the budget is spent.")
@click.option("--draft-vocab", type=int, default=8192, show_default=True,
              help="Rows of the head's output layer: the most frequent tokens of the training text.")
@click.option("--depth", type=int, default=1, show_default=True,
              help="Draft positions trained at once, as the drafter chains them (the first from the target's "
                   "hidden state, each later one from the head's own output); each adds to a step's time.")
@click.option("--precision", type=click.Choice(["auto", "bf16", "fp32"]), default="auto", show_default=True,
              help="Of the training's matrix products; auto: bf16 where the CPU has AVX-512 BF16 or AMX.")
@click.option("--noise", type=float, default=0.0, show_default=True,
              help="Uniform noise on the hidden states the head reads in training, as a share of their RMS "
                   "(EAGLE's regulariser; 0: none).")
@click.option("--weight-decay", type=float, default=0.0, show_default=True, help="AdamW's weight decay.")
# sidecar.MATRICES and DEFAULT_MATRICES, spelled out: importing them would load torch and gguf-py at every start
@click.option("--matrices", type=click.Choice(["Q4_0", "Q8_0", "F16"]), default="Q4_0", show_default=True,
              help="Form of the head's matrices in the sidecar: Q4_0 drafts from about half Q8_0's bytes.")
@click.option("--tokens", "generate_tokens", type=int, default=256, show_default=True,
              help="Tokens the target writes per built-in prompt.")
@click.option("--rounds", "generate_rounds", type=click.IntRange(min=1), default=4, show_default=True,
              help="Times the built-in prompts are answered at most while the writing share of the budget lasts "
                   "(rounds after the first sample every answer at T=0.7).")
@click.option("--stdlib-chunks", type=int, default=400, show_default=True,
              help="Passages of the Python standard library's sources offered as training text (the time budget "
                   "decides how many the target reads).")
@click.option("--fresh", is_flag=True, help="Start over instead of going on from the files an earlier run left (a finished run's too: "
                   "running the same command again trains the head further).")
@click.option("--out", type=click.Path(dir_okay=False), help="Sidecar path [the cache, where --drafter mtp looks].")
@click.option("--seed", type=int, default=0, show_default=True)
@friendly_errors
def distill(model, minutes, steps, draft_vocab, depth, precision, noise, weight_decay, matrices, generate_tokens,
            generate_rounds, stdlib_chunks, fresh, out, seed):
    """Train an MTP head for MODEL (catalog name or .gguf) on the CPU and cache it for `--drafter mtp`."""
    from pathlib import Path

    from outrider.plugins.drafters.mtp.distill import DistillSettings
    from outrider.plugins.drafters.mtp.distill import distill as run_distill

    settings = DistillSettings(minutes=minutes, steps=steps, draft_vocab=draft_vocab, depth=depth, precision=precision,
                               noise=noise, weight_decay=weight_decay, matrices=matrices,
                               generate_tokens=generate_tokens,
                               generate_rounds=generate_rounds, stdlib_chunks=stdlib_chunks, fresh=fresh, seed=seed)
    report = run_distill(model, settings, Path(out) if out else None, echo=lambda line: click.echo(line, err=True))
    click.echo(f"{report.sidecar} ({report.head_bytes / 1e6:.1f} MB) in {report.seconds / 60:.1f} min, "
               f"{report.steps} steps")
