"""One module per contender; each runs as its own process, driven by ``bench.py``.

The protocol (``common``): the child prints ``BENCH {"event": "ready"}`` once it is set up,
waits for ``go`` on stdin, does its work, prints ``BENCH {"event": "done", ...}``, then stays
idle until ``stop`` (so the parent can read its RSS at rest) and exits.
"""
