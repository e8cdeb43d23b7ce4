"""The pluggy hooks through which every plugin, built-in or third-party, registers itself.

Each registration hook receives a `register(name, factory, *, aliases=(), options={}, capabilities=None)`
callback. Hooks run once per process, before anything is decoded: the `register_*` hooks when the
registry is first built (the CLI's start, or the first `assemble`), `register_commands` when the CLI
builds its command group. Assembly then creates the plugins from the registered factories, and the
decode loop calls only those objects' methods, never a hook: no hook runs per token or per round.
"""

from __future__ import annotations

import pluggy

PROJECT = "outrider"
# The kinds of plugin, one registration hook each (`register_<kind>s`); every list of kinds is this one.
PLUGIN_KINDS = ("backend", "drafter", "acceptor")
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class OutriderSpec:
    @hookspec
    def register_backends(self, register):
        """Register backends: `register("cpu", CPUBackend, options={...})`."""

    @hookspec
    def register_drafters(self, register):
        """Register drafters: `register("lookup", LookupDrafter, aliases=("ngram",), options={...})`."""

    @hookspec
    def register_acceptors(self, register):
        """Register acceptors: `register("greedy", GreedyAcceptor)`."""

    @hookspec
    def register_commands(self, cli):
        """Add click commands to the `outrider` command group: `cli.add_command(my_command)`."""
