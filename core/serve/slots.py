"""How many generations a server runs at once (`-np/--parallel`, llama-server's flag), and each one's context.

llama-server's rules where it has them: four slots by default, and a `-c` that is given is the total, split
evenly across the slots. Where `-c` is left out each slot keeps the context one `generate` would have (a user
of one slot loses nothing to the others). Every slot's KV cache is allocated at start, so what does not fit in
memory is said then, with what would fit, not at the first busy minute. A default that does not fit shrinks to
what does; a count that was asked for is refused instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from outrider.errors import ConfigError

DEFAULT_SLOTS = 4  # llama-server's -np default
MIN_SLOT_CONTEXT = 64  # below this a slot holds no useful prompt
MEMORY_SHARE = 0.9  # of the memory available now that the caches may take: the rest is the process's own


@dataclass(frozen=True)
class SlotPlan:
    slots: int
    context: int  # each slot's
    cache_bytes: int  # all slots' KV caches together
    note: str = ""  # why the default was changed, for the operator


def kv_bytes_per_token(model) -> float:
    """What one position of the model's KV cache takes, measured on a small cache of its own kind."""
    cache = model.new_cache(64)
    tensors = [t for t in (*cache.keys, *cache.values) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors) / 64


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plan_slots(model, backend: str, context: int, context_given: bool, parallel: int | None,
               available: int | None = None) -> SlotPlan:
    """The slots a server runs: `parallel` (None: the default), each with its context, checked against memory.
    `context`: the runner's (the setting capped by the model); `context_given`: -c was set, so it is the total."""
    if parallel is not None and parallel < 1:
        raise ConfigError(f"-np {parallel}: a server needs at least one slot; give -np 1 or more")
    if not getattr(model, "batches", True) or backend != "cpu":
        why = (f"a {model.architecture} model runs one sequence at a time" if not getattr(model, "batches", True)
               else f"the {backend} backend serves one sequence at a time")
        if parallel is not None and parallel > 1:
            raise ConfigError(f"-np {parallel}: {why}; serve it with -np 1")
        parallel = 1
    default = parallel is None
    slots = DEFAULT_SLOTS if default else parallel
    per_token = kv_bytes_per_token(model)
    free = available_memory() if available is None else available
    note = ""
    while True:
        each = context // slots if context_given else context
        if each < MIN_SLOT_CONTEXT:
            raise ConfigError(f"-c {context} split over -np {slots} slots leaves {each} tokens a slot; raise -c or "
                              "lower -np")
        need = int(per_token * each * slots)
        if free is None or need <= MEMORY_SHARE * free:
            return SlotPlan(slots, each, need, note)
        fits = int(MEMORY_SHARE * free // (per_token * each))
        if default and fits >= 1 and not context_given:
            note = (f"{DEFAULT_SLOTS} slots of {each} tokens need {need / 2**30:.1f} GiB of KV cache, "
                    f"{free / 2**30:.1f} GiB is free: serving {fits}")
            slots = fits
            continue
        tokens = int(MEMORY_SHARE * free // per_token)
        raise ConfigError(f"-np {slots} slots of {each} tokens need {need / 2**30:.1f} GiB of KV cache but "
                          f"{free / 2**30:.1f} GiB is free: {max(fits, 0)} such slots fit, or {tokens} tokens in all "
                          f"(give -np {max(fits, 1)}, or -c {tokens // slots * slots} with -np {slots})")
