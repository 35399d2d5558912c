"""Reading file bytes into memory: parallel ``pread``/``O_DIRECT`` readers, or range requests through a
:class:`~shardkit.formats.ranges.RangeFile`; read plans, read-ahead, and the choice of backend.

One stage below :mod:`shardkit.sources` and :mod:`shardkit.loading`: ``shardkit.open`` and the
sources that ``split``, ``convert`` and ``verify`` read through share these readers.
"""
