"""``python -m shardkit``: the same command line as the ``shardkit`` script (e.g. under ``torchrun -m``)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main()
