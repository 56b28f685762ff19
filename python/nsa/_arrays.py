"""The array adapters: allocation, preparation and stream handling for numpy arrays and torch tensors."""
from __future__ import annotations

import operator
from typing import Any

from ._core import error

# The library wants workspaces 256-byte aligned (api.h).
_WORKSPACE_ALIGN = 256


class NumpyArrays:
    """Allocation and stream handling for numpy arrays (host only)."""

    def __init__(self):
        import numpy

        self.np = numpy

    def empty(self, shape, dtype, like):
        return self.np.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype, like):
        return self.np.zeros(shape, dtype=dtype)

    f32 = property(lambda self: self.np.float32)
    i32 = property(lambda self: self.np.int32)

    def prepare(self, x):
        """A version the library accepts: last dimension contiguous, no negative or zero strides."""
        if x is None:
            return None
        x = self.np.asarray(x)
        if x.ndim and (x.shape[-1] > 1 and x.strides[-1] != x.itemsize
                       or any(s <= 0 for s, n in zip(x.strides, x.shape) if n > 1)):
            x = self.np.ascontiguousarray(x)  # negative strides, or broadcast (stride 0) rows
        return x

    def workspace(self, nbytes: int, like):
        buf = self.np.empty(nbytes + _WORKSPACE_ALIGN, dtype=self.np.uint8)
        offset = (-buf.ctypes.data) % _WORKSPACE_ALIGN
        return buf[offset:offset + nbytes]

    def device(self, x) -> str:
        return "cpu"

    def stream(self, x) -> int:
        return 0

    def device_guard(self, x):
        return _NoGuard()

    def dtype_name(self, x) -> str:
        names = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int32": "i32"}
        return names.get(str(x.dtype), str(x.dtype))

    def to_int32(self, cu):
        np = self.np
        if not isinstance(cu, np.ndarray):
            try:  # a list of Python ints: checked as ints (numpy would make [0, 2**63] float64)
                values = [operator.index(v) for v in cu]
            except TypeError:
                values = None
            if values is not None:
                if values and (max(values) > 2**31 - 1 or min(values) < 0):
                    raise error("cu_seqlens", "out of int32 range", "must fit in int32")
                cu = np.array(values, dtype=np.int32)
            else:
                cu = np.asarray(cu)
        if not np.issubdtype(cu.dtype, np.integer):
            raise error("cu_seqlens.dtype", str(cu.dtype), "must be an integer type (offsets)")
        if cu.dtype != np.int32:
            if cu.size and (int(cu.max()) > 2**31 - 1 or int(cu.min()) < 0):
                raise error("cu_seqlens", "out of int32 range", "must fit in int32")
            cu = cu.astype(np.int32)
        return self.prepare(cu)

    def to_positions(self, positions, like):
        """Explicit rotary positions [T] as int32: any integer array, range-checked (a negative
        one is the library's error, named positions[t])."""
        np = self.np
        p = np.asarray(positions)
        if not np.issubdtype(p.dtype, np.integer):
            raise error("positions.dtype", str(p.dtype), "must be an integer type")
        if p.dtype != np.int32:
            if p.size and (int(p.max()) > 2**31 - 1 or int(p.min()) < -2**31):
                raise error("positions", "out of int32 range", "must fit in int32")
            p = p.astype(np.int32)
        return self.prepare(p)


class TorchArrays:
    """Allocation through PyTorch (its caching allocator on CUDA) on the inputs' device."""

    def __init__(self):
        import torch

        self.torch = torch

    f32 = property(lambda self: self.torch.float32)
    i32 = property(lambda self: self.torch.int32)

    def empty(self, shape, dtype, like):
        return self.torch.empty(shape, dtype=dtype, device=like.device)

    def zeros(self, shape, dtype, like):
        return self.torch.zeros(shape, dtype=dtype, device=like.device)

    def prepare(self, x):
        # DLPack refuses tensors that require grad; the operators handle autograd themselves.
        if x is None:
            return None
        x = x.detach()
        if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
            x = x.contiguous()
        if any(s == 0 for s, n in zip(x.stride(), x.shape) if n > 1):
            x = x.contiguous()  # expanded (broadcast) tensors: materialise for the library
        return x

    def workspace(self, nbytes: int, like):
        # The caching allocator returns 512-byte aligned blocks, but check rather than assume.
        buf = self.torch.empty(nbytes + _WORKSPACE_ALIGN, dtype=self.torch.uint8, device=like.device)
        offset = (-buf.data_ptr()) % _WORKSPACE_ALIGN
        return buf[offset:offset + nbytes]

    def device(self, x) -> str:
        return "cuda" if x.device.type == "cuda" else "cpu"

    def stream(self, x) -> int:
        if x.device.type != "cuda":
            return 0
        return int(self.torch.cuda.current_stream(x.device).cuda_stream)

    def device_guard(self, x):
        if x.device.type == "cuda":
            return self.torch.cuda.device(x.device)
        return _NoGuard()

    def dtype_name(self, x) -> str:
        t = self.torch
        names = {t.float32: "f32", t.float64: "f64", t.float16: "f16", t.bfloat16: "bf16", t.int32: "i32"}
        return names.get(x.dtype, str(x.dtype).replace("torch.", ""))

    def to_int32(self, cu):
        if cu.dtype != self.torch.int32 and not cu.is_floating_point():
            cu = torch_offsets_to_int32(cu)
        return self.prepare(cu)

    def to_positions(self, positions, like):
        """Explicit rotary positions [T] as int32 on like's device. Host positions of any integer
        type are range-checked and copied over; positions on a GPU must be int32 already (checking
        an int64 tensor's range there would need a synchronisation, as for offsets)."""
        torch = self.torch
        if not isinstance(positions, torch.Tensor):
            positions = torch.as_tensor(positions)
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise error("positions.dtype", self.dtype_name(positions), "must be an integer type")
        if positions.dtype != torch.int32:
            if positions.device.type != "cpu":
                raise error("positions.dtype", f"{self.dtype_name(positions)} on {positions.device}",
                            "must be int32 for positions on a GPU (convert with .int(), or pass host positions, "
                            "which are range-checked)")
            if (positions.numel() and not torch.compiler.is_compiling()
                    and (int(positions.max()) > 2**31 - 1 or int(positions.min()) < -2**31)):
                raise error("positions", "out of int32 range", "must fit in int32")
            positions = positions.to(torch.int32)
        if positions.device.type == "cpu" and like.device.type != "cpu":
            positions = positions.to(like.device)
        return self.prepare(positions)


def check_device_offsets(cu) -> None:
    """Offsets on a GPU must be int32 already. Converting an int64 tensor there would need a range
    check (2^32 + 10 would act as 10), and reading it a synchronisation, which the library never
    makes (CUDA graphs); host offsets of any integer type are checked and converted instead."""
    import torch

    if cu.device.type != "cpu" and cu.dtype != torch.int32:
        raise error("cu_seqlens.dtype", f"{str(cu.dtype).replace('torch.', '')} on {cu.device}",
                    "must be int32 for offsets on a GPU (convert with .int(), or pass host offsets, which are "
                    "range-checked)")


def torch_offsets_to_int32(cu):
    """An integer offsets tensor as int32. Host offsets are range-checked like NumPy's; device
    offsets must be int32 already (check_device_offsets)."""
    import torch

    check_device_offsets(cu)
    if (cu.device.type == "cpu" and cu.numel() and not torch.compiler.is_compiling()
            and (int(cu.max()) > 2**31 - 1 or int(cu.min()) < 0)):
        raise error("cu_seqlens", "out of int32 range", "must fit in int32")
    return cu.to(torch.int32)


class _NoGuard:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NUMPY = None
_TORCH = None


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def arrays_for(x) -> Any:
    """The framework of an array: torch tensors, or anything numpy can take."""
    global _NUMPY, _TORCH
    if is_torch(x):
        if _TORCH is None:
            _TORCH = TorchArrays()
        return _TORCH
    if _NUMPY is None:
        _NUMPY = NumpyArrays()
    return _NUMPY
