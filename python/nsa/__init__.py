"""Native Sparse Attention (Yuan et al., arXiv 2502.11089) for NumPy and PyTorch.

Functional API (numpy arrays and torch tensors, host or CUDA): ``attention`` and its stages
``compress``, ``compressed_attention``, ``select_topn``, ``selected_attention``,
``window_attention``, plus ``dense_attention`` and ``rotary`` (rotary position embeddings).
PyTorch layer: ``nsa.NativeSparseAttention`` (imported on first use, so that numpy users never
import torch); context parallelism over ``torch.distributed``: ``nsa.distributed`` (likewise). See
docs/python.md and docs/distributed.md.
"""
from ._core import CacheArrays, Config, Error, Phi
# __version__: CMakeLists.txt's project version, compiled into the extension.
from ._nsa import __version__, backbone_schedule, backend_available
from .functional import (
    AttentionAux,
    Gradients,
    attention,
    attention_backward,
    attention_branches,
    cache_append,
    compress,
    compress_backward,
    compressed_attention,
    dense_attention,
    dense_attention_backward,
    dense_decode,
    decode,
    rotary,
    select_topn,
    selected_attention,
    window_attention,
)

__all__ = [
    "AttentionAux", "CacheArrays", "Config", "Error", "Gradients", "NSACache", "NativeSparseAttention", "Phi",
    "attention", "attention_backward", "attention_branches", "backbone_schedule", "backend_available", "cache_append",
    "compress",
    "compress_backward", "compressed_attention", "decode", "dense_attention", "dense_attention_backward",
    "dense_decode", "rotary", "select_topn", "selected_attention", "window_attention",
]


def __getattr__(name):
    # The PyTorch layer imports torch; load it only when asked for.
    if name in ("NativeSparseAttention", "NSACache"):
        from . import modules

        return getattr(modules, name)
    if name == "distributed":  # context parallelism over torch.distributed (docs/distributed.md)
        import importlib

        return importlib.import_module(__name__ + ".distributed")
    raise AttributeError(f"module 'nsa' has no attribute {name!r}")
