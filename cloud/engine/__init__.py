"""The target as it runs inside Triton's Python backend: torch, the CPU kernels, KV slots.

``target.TargetModel`` serves every request of a pass in one forward pass (``ragged`` in torch,
``kernel_forward`` on the CPU kernels of ``cpu_kernels.c``); ``batch.BatchEngine`` forms the
passes; ``decoder`` says where the model families differ; ``precision`` chooses the weights'
format at load. ``model_repository/target/1/model.py`` is a thin shell over this package.
"""
