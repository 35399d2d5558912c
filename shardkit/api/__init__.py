"""The application layer: the one front door that the CLI and Python callers share.

It turns any source (a local path, ``hf://`` cached or streamed, a torchrun group) into an
opened source and owns every composite operation (split then push, the collective convert,
``hf://`` for plan and fit, plan with strategies, recover). ``shardkit/__init__`` exports from
it, and ``shardkit/cli`` imports nothing else of shardkit but ``errors`` and ``units``.

Its modules import the stages lazily (inside the functions), so importing one stays light.
"""
