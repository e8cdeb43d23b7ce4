"""The `mtp` drafter as one package: the head and the drafter that runs it (drafter.py), the training that
makes a head for a model that shipped without one (distill.py), and its `outrider distill` command
(command.py, added to the CLI through the `register_commands` hook)."""

from __future__ import annotations

from outrider.hookspecs import hookimpl
from outrider.plugins.drafters.mtp.drafter import MTPDrafter, MTPHead, mtp_sidecar_path, register_drafters

__all__ = ["MTPDrafter", "MTPHead", "mtp_sidecar_path", "register_drafters", "register_commands"]


@hookimpl
def register_commands(cli):
    from outrider.plugins.drafters.mtp.command import distill

    cli.add_command(distill)
