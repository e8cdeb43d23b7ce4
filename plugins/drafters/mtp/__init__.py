"""The `mtp` drafter as one package: the head in its drafting and its training form, one forward (head.py),
the file a trained head is written to (sidecar.py), the drafter that runs it (drafter.py), the training that
makes a head for a model that shipped without one (distill.py) and the training that goes on while it drafts
(learn.py, `-o drafter.learn true`), and the `outrider distill` command (command.py, added to the CLI through
the `register_commands` hook)."""

from __future__ import annotations

from outrider.hookspecs import hookimpl
from outrider.plugins.drafters.mtp.drafter import MTPDrafter, mtp_sidecar_path, register_drafters
from outrider.plugins.drafters.mtp.head import MTPHead, TrainableHead

__all__ = ["MTPDrafter", "MTPHead", "TrainableHead", "mtp_sidecar_path", "register_drafters", "register_commands"]


@hookimpl
def register_commands(cli):
    from outrider.plugins.drafters.mtp.command import distill

    cli.add_command(distill)
