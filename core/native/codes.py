"""The codes shared by Python and the CPU kernels (`kernels/common.h`), written once on the Python side.

The compiled module exports the same tables (`WEIGHT_KINDS`, `ACTIVATIONS`, `KV_MODES`, `KEY_BLOCK`);
Python keeps this copy because the torch path (`OUTRIDER_NATIVE=0`, or no compiler) lays out caches and
weights without loading the module, and a test checks the two agree.
"""

from __future__ import annotations

# How a PackedLinear holds its weight: packed nibbles, int8 codes, float32, 5-bit codes.
WEIGHT_KINDS = {"q4": 0, "q8": 1, "f32": 2, "q5": 3}
# The activation applied to the gate half of the input before a linear (the kernels' `act`).
ACTIVATIONS = {"none": 0, "silu": 1, "gelu_tanh": 2}
# Where a layer's keys and values come from (`attend`'s kv_mode): its own projections, keys used as the
# values too, or an earlier layer's cache.
KV_MODES = {"own": 0, "k_is_v": 1, "shared": 2}
# Positions per block of a transposed key cache: the native attention reads keys this many at a time.
KEY_BLOCK = 64
