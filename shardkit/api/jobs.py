"""Publishing and torchrun groups: ``shardkit.push``, and the group a collective convert runs in.

``split_and_push`` (split, then push with the preflight first) lives with ``split`` in
:mod:`shardkit.api.checkpoints`, so a split that pushes nothing never imports ``hub/``.
The collective convert is ``shardkit.convert(..., collective=True)`` under :func:`torchrun_group`.
"""

from __future__ import annotations

from ..distributed.group import group_from_env as torchrun_group
from ..distributed.group import is_rank_zero
from ..hub.push import PushResult, push

__all__ = ["PushResult", "is_rank_zero", "push", "torchrun_group"]
