"""Torch's intra-op thread count for a block of work, restored afterwards.

Tiny-model tests and contract checks run on one thread: their tensors are a few hundred values wide, so an
OpenMP hand-off costs more than it saves, and on a busy machine each one stalls for milliseconds (the
non-slow suite took 672 s on two shared cores, 37 s on one thread). The native kernels run on torch's pool
(at::parallel_for), so this sets their thread count too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)``; ``n <= 0`` leaves torch's setting alone."""
    if n <= 0:
        yield
        return
    import torch  # late: the pytest plugin imports this module in projects that never use torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
