"""Exporting a Hugging Face checkpoint to the edge's ONNX draft: a build step (needs onnx),
never on the edge's run-time path. ``exporter.export_onnx`` is the entry point; ``families``
reads a config into a spec, ``onnx_graph`` builds the graph (``onnx_builder``, ``onnx_quant``,
``rope``).
"""
