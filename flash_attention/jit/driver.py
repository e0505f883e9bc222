"""The few CUDA driver API calls needed to load a cubin and launch a kernel, through ctypes.

Kernels are loaded with the context-independent library API (cuLibraryLoadData, CUDA 12.0+), so one loaded
cubin serves whichever context (PyTorch's primary context of the tensor's device) is current at launch.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from functools import cache

CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


class DriverError(RuntimeError):
    pass


@cache
def libcuda() -> ctypes.CDLL:
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise DriverError("the CUDA driver (libcuda.so.1) was not found")
    check(lib.cuInit(0), "cuInit")
    return lib


def driver_version() -> int:
    """The CUDA version the installed driver supports, as cuDriverGetVersion says it: 1000 x major + 10 x
    minor (13000 for CUDA 13.0)."""
    version = ctypes.c_int()
    check(libcuda().cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value


def check(status: int, what: str) -> None:
    if status != 0:
        lib = _raw()
        msg = ctypes.c_char_p()
        if lib is not None:
            lib.cuGetErrorString(status, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else f"error {status}"
        raise DriverError(f"{what} failed: {text} ({status})")


@cache
def _raw() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@cache
def _launch_kernel():
    """cuLaunchKernel with its argument types declared, so ctypes converts the Python ints without guessing
    (and a stream handle above 2**31 is passed as a pointer, not truncated to an int)."""
    fn = libcuda().cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    return fn


#: The launch attribute that lets a kernel start before the one ahead of it on the stream has finished
#: (programmatic dependent launch, compute capability 9.0+; the kernel waits for it itself:
#: fa/grid_dependency.cuh), and cuLaunchKernelEx's structures that carry it (cuda.h: CUlaunchAttribute is
#: the attribute's id, padding to 8 bytes and a 64-byte value union; CUlaunchConfig the launch's shape).
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_int),
        ("pad", ctypes.c_char * 4),
        ("value", ctypes.c_int),  # the union's first int: programmaticStreamSerializationAllowed
        ("rest", ctypes.c_char * 60),
    ]


class LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("smem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


@cache
def _launch_kernel_ex():
    """cuLaunchKernelEx (CUDA 12.0+), or None on a driver without it (launches then are all ordinary)."""
    fn = getattr(libcuda(), "cuLaunchKernelEx", None)
    if fn is not None:
        fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return fn


class Kernel:
    """One entry point of a loaded cubin."""

    def __init__(self, library: ctypes.c_void_p, handle: ctypes.c_void_p, name: str):
        self._library = library  # keeps the library alive as long as the kernel
        self.handle = handle
        self.name = name
        self._smem_set: dict[int, int] = {}
        self._occupancy: dict[tuple[int, int, int], int] = {}

    def attribute(self, attr: int, device: int) -> int:
        lib = libcuda()
        value = ctypes.c_int()
        check(
            lib.cuKernelGetAttribute(ctypes.byref(value), attr, self.handle, cu_device(device)),
            "cuKernelGetAttribute",
        )
        return value.value

    def ensure_dynamic_smem(self, nbytes: int, device: int) -> None:
        # More than 48 KB of dynamic shared memory needs an explicit opt-in per kernel (and per device).
        if self._smem_set.get(device, -1) >= nbytes:
            return
        lib = libcuda()
        check(
            lib.cuKernelSetAttribute(
                CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes, self.handle, cu_device(device)
            ),
            f"setting {nbytes} bytes of dynamic shared memory on {self.name}",
        )
        self._smem_set[device] = nbytes

    def blocks_per_sm(self, threads: int, smem: int, device: int) -> int:
        """How many blocks of ``threads`` threads and ``smem`` bytes of dynamic shared memory one
        multiprocessor of ``device`` runs at once (the driver's occupancy calculator: registers, shared
        memory, threads); cached per shape. Opts the kernel into ``smem`` bytes first, as a launch needs."""
        key = (device, threads, smem)
        if key not in self._occupancy:
            self.ensure_dynamic_smem(smem, device)
            lib = libcuda()
            previous = make_primary_current(device)  # the function handle belongs to a context
            try:
                function, blocks = ctypes.c_void_p(), ctypes.c_int()
                check(lib.cuKernelGetFunction(ctypes.byref(function), self.handle), "cuKernelGetFunction")
                check(
                    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                        ctypes.byref(blocks), function, threads, ctypes.c_size_t(smem)
                    ),
                    f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})",
                )
            finally:
                if previous is not None:
                    set_current(previous)
            self._occupancy[key] = max(1, blocks.value)
        return self._occupancy[key]

    def launch(
        self, grid, block, smem: int, stream: int, params: ctypes.Structure, programmatic: bool = False
    ) -> None:
        """Queue the kernel on ``stream`` with ``params`` (the kernel's one by-value argument). The driver
        copies the argument at the call, so ``params`` may be reused or freed as soon as this returns.
        ``programmatic``: it may start before the kernel ahead of it on the stream has finished (a kernel
        that waits for it itself, fa/grid_dependency.cuh; the caller asks only on compute capability 9.0+)."""
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        launch_ex = _launch_kernel_ex() if programmatic else None
        if launch_ex is not None:
            attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
            config = LaunchConfig(
                (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, stream, ctypes.pointer(attr), 1
            )
            status = launch_ex(ctypes.byref(config), self.handle, args, None)
        else:
            status = _launch_kernel()(
                self.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, stream, args, None
            )
        if status != 0:
            check(status, f"launching {self.name}")


def load_library(cubin: bytes) -> ctypes.c_void_p:
    lib = libcuda()
    handle = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(cubin, len(cubin))
    check(lib.cuLibraryLoadData(ctypes.byref(handle), buf, None, None, 0, None, None, 0), "cuLibraryLoadData")
    return handle


def get_kernel(library: ctypes.c_void_p, name: str) -> Kernel:
    lib = libcuda()
    handle = ctypes.c_void_p()
    check(lib.cuLibraryGetKernel(ctypes.byref(handle), library, name.encode()), f"cuLibraryGetKernel({name})")
    return Kernel(library, handle, name)


@cache
def _ctx_functions():
    lib = libcuda()
    get, set_ = lib.cuCtxGetCurrent, lib.cuCtxSetCurrent
    get.argtypes, get.restype = [ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
    set_.argtypes, set_.restype = [ctypes.c_void_p], ctypes.c_int
    return get, set_


@cache
def primary_context(ordinal: int) -> int:
    """The primary context of device ``ordinal``: the one PyTorch's runtime API uses. Retained once for the
    life of the process (PyTorch holds it just as long)."""
    ctx = ctypes.c_void_p()
    check(
        libcuda().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), cu_device(ordinal)), "cuDevicePrimaryCtxRetain"
    )
    return ctx.value


def make_primary_current(ordinal: int) -> int | None:
    """Make device ``ordinal``'s primary context current on this thread; return the context that was current
    before if it was another one (for :func:`set_current` to restore), else None.

    A launch goes to whatever context is current on the calling thread, and a thread PyTorch has not yet
    made a runtime call on has none: the autograd engine runs a backward on a thread of its own, and
    PyTorch skips setting the device there when it already reads as the wanted ordinal (cudaGetDevice
    answers 0 before any context is current), so our first launch on it failed with "invalid device
    context". One cuCtxGetCurrent (well under a microsecond) per launch settles it for every thread."""
    get, set_ = _ctx_functions()
    current = ctypes.c_void_p()
    check(get(ctypes.byref(current)), "cuCtxGetCurrent")
    wanted = primary_context(ordinal)
    if current.value == wanted:
        return None
    check(set_(wanted), "cuCtxSetCurrent")
    return current.value  # None when no context was current: leaving ours current is what PyTorch would do


def set_current(ctx: int) -> None:
    check(_ctx_functions()[1](ctx), "cuCtxSetCurrent")


@contextmanager
def primary_current(ordinal: int):
    """:func:`make_primary_current` for a block of driver calls (tensor-map encodes fail with "invalid device
    context" as launches do), the caller's context put back after."""
    previous = make_primary_current(ordinal)
    try:
        yield
    finally:
        if previous is not None:
            set_current(previous)


@cache
def cu_device(ordinal: int) -> int:
    dev = ctypes.c_int()
    check(libcuda().cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    return dev.value


def device_attribute(attr: int, device: int) -> int:
    value = ctypes.c_int()
    check(
        libcuda().cuDeviceGetAttribute(ctypes.byref(value), attr, cu_device(device)), "cuDeviceGetAttribute"
    )
    return value.value


# ---------------------------------------------------------------------------------------------------------
# Tensor maps (the TMA unit's descriptors of a global tensor, cuTensorMapEncodeTiled, CUDA 12.0+)

CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0  # 1-byte elements copied as bits: e4m3
CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1  # 2-byte elements copied as bits: fp16 and bf16 alike
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_64B = 2
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION_256B = 3
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements read as zeros
#: cuTensorMapEncodeTiled's enum arguments for every map of ours, in its order: data type, interleave,
#: swizzle, L2 promotion, out-of-bounds fill (the host library's repeat call encodes with them too).
TENSOR_MAP_ENCODE_FLAGS = (
    CU_TENSOR_MAP_DATA_TYPE_UINT16,
    CU_TENSOR_MAP_INTERLEAVE_NONE,
    CU_TENSOR_MAP_SWIZZLE_128B,
    CU_TENSOR_MAP_L2_PROMOTION_256B,
    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
)


@cache
def _encode_tiled():
    fn = libcuda().cuTensorMapEncodeTiled
    fn.argtypes = (
        [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
        + [ctypes.c_void_p] * 4
        + [ctypes.c_int] * 4
    )
    fn.restype = ctypes.c_int
    return fn


_ONES = (ctypes.c_uint32 * 5)(1, 1, 1, 1, 1)


def encode_tiled_2byte(dest: int, address: int, dims, strides, box) -> int:
    """Encode a tiled tensor map of 2-byte elements with the 128-byte swizzle into the 128 bytes at
    ``dest`` (64-byte aligned); return the driver's status (0: success). ``dims`` (ctypes uint64 array,
    innermost first) and ``box`` (uint32, same rank) in elements, ``strides`` (uint64, rank - 1) in bytes
    for every dimension but the innermost; elements outside ``dims`` load as zeros."""
    data_type, *layout_flags = TENSOR_MAP_ENCODE_FLAGS
    return _encode_tiled()(dest, data_type, len(dims), address, dims, strides, box, _ONES, *layout_flags)


def encode_tiled_1byte(
    dest: int, address: int, dims, strides, box, swizzle: int = CU_TENSOR_MAP_SWIZZLE_128B
) -> int:
    """encode_tiled_2byte for 1-byte elements (e4m3): a 128-byte swizzle panel is then 128 of them.
    ``swizzle``: CU_TENSOR_MAP_SWIZZLE_64B for boxes of 64-byte rows (e4m3's Q and K at head_dim 64, read by
    wgmma with the same 64-byte swizzle: fa/wgmma.cuh smem_desc_sw64)."""
    _, interleave, _, promotion, fill = TENSOR_MAP_ENCODE_FLAGS
    data_type = CU_TENSOR_MAP_DATA_TYPE_UINT8
    return _encode_tiled()(
        dest, data_type, len(dims), address, dims, strides, box, _ONES, interleave, swizzle, promotion, fill
    )
