"""``specsplit-edge serve``: the OpenAI-compatible HTTP endpoint in front of the split client
(``app``), its request schema, text handling, drafter pool, limits and cloud health probe.
"""
