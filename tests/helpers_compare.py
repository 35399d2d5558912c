"""Comparing computed float outputs (forward passes, generated images) within their dtype's tolerance.

Bytes that are copied (weights, dequantized tensors, shards) are compared exactly, with ``torch.equal``.
A forward pass is a computation: CPU kernels, thread counts and memory alignment change the order of
float sums, so the same weights give outputs a few units in the last place apart from one machine to
the next. Those are compared here, with a tolerance derived from the dtype: ``ulps`` machine epsilons
relative to the output's largest magnitude (at least 1). A wrong weight, scale or layer moves the
output by far more than that.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

DEFAULT_ULPS = 64  # fp32: ~7.6e-6 of the largest output magnitude; bf16: 0.5; fp16: 0.06


def output_tolerance(want: torch.Tensor, *, ulps: int = DEFAULT_ULPS) -> float:
    """The largest absolute difference allowed between two computations of ``want``."""
    eps = torch.finfo(want.dtype).eps
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    return ulps * eps * scale


def assert_outputs_close(got: Any, want: Any, *, ulps: int = DEFAULT_ULPS) -> None:
    """``got`` equals ``want`` (tensors or numpy arrays of the same float dtype and shape) within the tolerance."""
    got_t = torch.from_numpy(np.asarray(got)) if not isinstance(got, torch.Tensor) else got
    want_t = torch.from_numpy(np.asarray(want)) if not isinstance(want, torch.Tensor) else want
    assert got_t.dtype == want_t.dtype and got_t.dtype.is_floating_point, (got_t.dtype, want_t.dtype)
    assert got_t.shape == want_t.shape, (tuple(got_t.shape), tuple(want_t.shape))
    got_t, want_t = got_t.detach().cpu(), want_t.detach().cpu()
    assert bool(torch.isfinite(want_t).all()), "the reference output is not finite"
    tol = output_tolerance(want_t, ulps=ulps)
    diff = float((got_t.float() - want_t.float()).abs().max()) if want_t.numel() else 0.0
    assert diff <= tol, f"outputs differ by {diff:.3g} (> {tol:.3g}, {ulps} ulps of {want_t.dtype})"
