"""The jitbyoc benchmark harness: ``python -m bench --help``.

See ``bench/README.md`` for what is measured and how. Importing this package imports
nothing heavy, so ``--threads`` can still configure TVM's thread pool.
"""
