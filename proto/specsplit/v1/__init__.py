"""specsplit.v1: the protocol's Python stubs, generated from ``speculative.proto`` beside this file.

``speculative_pb2`` and ``speculative_pb2_grpc`` are written here at build time (the wheel's build
hook in ``setup.py``, or ``make proto`` in a checkout); they are never committed.
"""
