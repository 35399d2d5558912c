"""Fitting a model to memory: one peak model priced by ``shardkit.fit`` and ``shardkit.estimate_memory``.

(The folder is ``fitting``, not ``fit``: a subpackage named ``fit`` would replace the public
function ``shardkit.fit`` as soon as any of its modules was imported.)

Modules, each importing only those above it: :mod:`.activations` (activation bytes per workload),
:mod:`.weights` (weights per offload unit), :mod:`.profile` (one component's weights, activations
and switches), :mod:`.peaks` (the strategy table and its peak formulas), :mod:`.candidates`
(budgets, margin, ranking), :mod:`.autofit` (``fit``, ``plan_fit``, ``apply_plan``),
:mod:`.estimate` (``estimate_memory``) and :mod:`.pipeline` (``load_pipeline``).
"""

from __future__ import annotations
