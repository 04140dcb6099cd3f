"""The training job (issue 7): job YAML (``config``), data sources (``data``), metrics,
checkpoints, and the entry point ``python -m fbtriton_dist.train`` (``job.main``).

Importing this package loads nothing heavy: ``config`` never imports torch, so the
``fbtriton-dist`` command parses its arguments without it.
"""
