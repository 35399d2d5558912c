"""Fitting a model to memory: one peak model priced by ``shardkit.fit`` and ``shardkit.estimate_memory``.

Modules, each importing only those above it: :mod:`.activations` (activation bytes per workload),
:mod:`.weights` (weights per offload unit), :mod:`.profile` (one component's weights, activations
and switches), :mod:`.peaks` (the strategy table and its peak formulas), :mod:`.candidates`
(budgets, margin, ranking), :mod:`.autofit` (``fit``, ``plan_fit``, ``apply_plan``),
:mod:`.estimate` (``estimate_memory``) and :mod:`.pipeline` (``load_pipeline``).
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    # Importing any shardkit.fit.* module binds the name ``shardkit.fit`` to this package, hiding
    # the public function of the same name; calling the package keeps ``shardkit.fit(...)`` working.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .autofit import fit

        return fit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
