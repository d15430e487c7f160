"""Processes: the bundled tritonserver started and restarted (``triton``, ``supervisor``), and
``process.CloudProcess``, a whole ``specsplit-cloud serve`` run as a child (tests, benchmarks).
"""
