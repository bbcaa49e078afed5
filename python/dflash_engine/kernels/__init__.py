"""Triton GPU kernels, each beside its torch reference twin in `dflash_engine.ops`.

The repository's top-level `kernels/` is a link to this package so that the wheel carries
the kernels the engine imports. Tests run them on the GPU, and on CPU under Triton's
interpreter (`TRITON_INTERPRET=1`, set by tests/conftest.py when no GPU is present).
"""
