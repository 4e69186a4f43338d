"""The compiled tiles (`native_tiles.cpp`): every pass of attention (forward, backward,
JVP, the backward's JVP, double backward) with the causal diagonal, a boolean mask, a float
bias and its gradient, key bounds (the structured masks), a soft cap, dropout and GQA;
float32 or float64 (float16 and bfloat16 computed in float32), on the CPU; and the dropout
keep-masks of `dropout` for the torch-ops kernels. Every entry point takes one `AttentionCall`: the sizes, options and named
buffers of a call, whose layout the library states and `library()` checks.

The torch-ops kernels (`kernels`) run any case on any device, but each of their passes is a
separate sweep over a score tile too large for the cache. The compiled tiles fuse those
passes per thread on tiles that stay in cache, as PyTorch's own flash kernel does, and
reach its speed. They are built on first use with the system's C++ compiler (10-11 s on 2
cores, as `status()` measures) into a cache folder, and loaded with ctypes; the GEMMs are the BLAS inside PyTorch
(MKL on x86-64 Linux). Where any of that is missing, `library()` is None and `kernels`
runs instead: the same numbers to rounding, more slowly.

ATTNGRAD_NATIVE=0 turns the tiles off; ATTNGRAD_CACHE names the cache folder (default
~/.cache/attngrad); CXX names the compiler (default c++). ATTNGRAD_SANITIZE=1 builds them
with AddressSanitizer and UndefinedBehaviorSanitizer instead (for `scripts/sanitize_tiles.sh`,
which preloads the sanitizer runtime that a Python process needs for such a library).

The results do not depend on the thread count: work items own their outputs, and how
the work is split into items depends on the shapes alone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .dropout import Placement

SOURCE = Path(__file__).with_name("native_tiles.cpp")
# -fno-trapping-math lets the row loops' compares and selects vectorise; -ffp-contract=fast
# turns their a * b + c into FMAs. No -ffast-math: the code relies on -inf and exact order.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-fopenmp", "-fPIC",
         "-shared", "-std=c++17")
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")


def _flags() -> tuple[str, ...]:
    return FLAGS + (SANITIZE_FLAGS if os.environ.get("ATTNGRAD_SANITIZE") == "1" else ())
# Rows of a query block and keys of a key block. A (128, 512) float32 score tile is 256 KiB;
# the backward's two of them and their K, V blocks stay in a core's L2 cache. Fwd+bwd at
# B=1, H=8, L=4096, d=64, as a share of PyTorch's flash kernel's time, full / causal:
# (32, 512) 1.10 / 1.05, (64, 512) 1.00 / 0.96, (128, 256) 0.95 / 0.87, (128, 512) 0.93 /
# 0.88, (256, 256) 0.93 / 0.85, (128, 1024) 0.97 / 1.01.
BLOCK_ROWS = 128
BLOCK_KEYS = 512
# Keys per block where every row's bounds span at most NARROW_BAND keys.
NARROW_BAND = 1024
NARROW_BLOCK_KEYS = 128
# The forward's E V product sums this many keys per GEMM, for float32 accuracy: at B=2,
# H=4, L=1024 the output's normwise error against PyTorch's flash kernel's went from
# 1.02x (one 512-key product) to below it (figures in the tests).
VALUE_SLICE = 128
# Numbers in each of the double backward's four whole-row tiles (R x Lk'), 4 MiB of float32
# (16 MiB per thread). Its GEMMs want tall blocks more than the tiles want cache: at L=4096
# the pass took 1033 ms with 16 rows, 817 with 32, 700 with 64 and 681 with 128 (scalar row
# loops; 655 once they were vectorised).
DOUBLE_TILE = 1 << 20

_BLAS_SYMBOLS = ("SGEMM", "DGEMM")  # the Fortran interface, 32-bit integers
_LOCAL_THREADS = "MKL_Set_Num_Threads_Local"


@dataclass
class BuildInfo:
    """How the library was had: its path, whether it was compiled in this process, the
    seconds that took, or why it is unavailable."""

    path: Path | None = None
    compiled: bool = False
    seconds: float = 0.0
    reason: str | None = None

    def reset(self) -> None:
        self.path, self.compiled, self.seconds, self.reason = None, False, 0.0, None


build_info = BuildInfo()


def _cache_dir() -> Path:
    root = os.environ.get("ATTNGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "attngrad"
    )
    return Path(root)


def _machine_key() -> str:
    """What the built binary depends on: the source, the flags, the compiler and the CPU
    (-march=native), so a cache folder shared between machines does not hand one the other's."""
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu += "".join(line for line in info if line.startswith(("model name", "flags")))
    except OSError:
        pass
    text = SOURCE.read_bytes() + " ".join(_flags()).encode() + os.environ.get("CXX", "c++").encode() + cpu.encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _compile(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [os.environ.get("CXX", "c++"), *_flags(), str(SOURCE), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent process sees all of it or none


@functools.cache
def fresh_build_seconds() -> float:
    """Seconds a first use spends compiling the tiles (timed into a scratch folder, so the
    cache is not touched): what a new machine pays once. Timed once per process."""
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        _compile(Path(scratch) / "native_tiles.so")
        return time.perf_counter() - start


def status() -> str:
    """One line for reports: whether the tiles run, and what their first use costs."""
    if library() is None:
        return f"compiled tiles unavailable ({build_info.reason}); torch-ops kernels throughout"
    return (f"compiled tiles for every pass with masks, a bias and its gradient, and dropout (first use compiles "
            f"them once: {fresh_build_seconds():.1f} s on this machine, then cached)")


def _blas_symbols() -> list[int]:
    """Addresses of sgemm, dgemm and MKL's per-thread thread count inside PyTorch's own library."""
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))  # already loaded
    addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _BLAS_SYMBOLS]
    local = getattr(lib, _LOCAL_THREADS, None)
    return [*addresses, ctypes.cast(local, ctypes.c_void_p).value if local is not None else None]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded tiles, or None (and `build_info.reason` says why)."""
    build_info.reset()
    if os.environ.get("ATTNGRAD_NATIVE", "1") == "0":
        build_info.reason = "turned off by ATTNGRAD_NATIVE=0"
        return None
    try:
        blas = _blas_symbols()
        target = _cache_dir() / f"native_tiles-{_machine_key()}.so"
        if not target.exists():
            start = time.perf_counter()
            _compile(target)
            build_info.compiled, build_info.seconds = True, time.perf_counter() - start
        lib = ctypes.CDLL(str(target))
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as error:
        build_info.reason = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"attngrad: the compiled attention tiles are unavailable ({build_info.reason}); "
            "the torch-ops kernels run instead, exact but slower",
            stacklevel=2,
        )
        return None
    lib.attngrad_call_layout.restype = ctypes.c_char_p
    theirs = lib.attngrad_call_layout().decode()
    if theirs != AttentionCall.layout():
        build_info.reason = f"the library's call layout differs from native.py's: {theirs!r}"
        warnings.warn(f"attngrad: {build_info.reason}; the torch-ops kernels run instead", stacklevel=2)
        return None
    build_info.path = target
    lib.attngrad_set_blas.argtypes = [ctypes.c_void_p] * 3
    lib.attngrad_set_blas(*blas)
    lib.attngrad_error.restype = ctypes.c_char_p
    call = ctypes.POINTER(AttentionCall)
    for name in ("attngrad_forward", "attngrad_backward", "attngrad_double_backward", "attngrad_jvp",
                 "attngrad_backward_jvp"):
        getattr(lib, name).argtypes = [call]
    lib.attngrad_bias_grad_parts.argtypes, lib.attngrad_bias_grad_parts.restype = [call, ctypes.c_int], ctypes.c_int64
    p, i64, u64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int, ctypes.c_double
    lib.attngrad_dropout_keep_scale.argtypes = [i32, p, i64, i64, i64, i64, i64, i64, i64, u64, u64, f64, i32]
    return lib


# The buffers of a call, in the order of the library's ATTNGRAD_BUFFERS.
BUFFERS = ("q", "k", "v", "mask", "bias", "out", "row_max", "inv_sum", "dout", "delta", "dq_parts", "dk", "dv",
           "dbias_parts", "gq", "gk", "gv", "g_dout", "g_q", "gk_parts", "gv_parts", "tq", "tk", "tv", "tbias", "tout",
           "tdout", "tdq", "tdk_parts", "tdv_parts", "tdbias_parts", "gbias", "g_bias_parts", "key_bounds")


class AttentionCall(ctypes.Structure):
    """One call of a pass, as every entry point of the library takes it (its AttngradCall):
    the sizes, the options and the buffers. `library()` compares the two layouts before it
    hands out the library. Fill one with `describe`."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("batch", "heads", "kv_heads", "len_q", "len_k", "dim", "dim_v")),
        # (b, h, i, j), each 1 or the scores' own
        ("mask_sizes", ctypes.c_int64 * 4), ("bias_sizes", ctypes.c_int64 * 4),
        ("double_precision", ctypes.c_int64), ("causal", ctypes.c_int64), ("causal_offset", ctypes.c_int64),
        ("bounds_batch", ctypes.c_int64),  # key_bounds (1 or B, Lq, 2)
        ("scale", ctypes.c_double), ("softcap", ctypes.c_double), ("dropout", ctypes.c_int64), ("seed", ctypes.c_uint64),
        ("threshold", ctypes.c_uint64), ("keep_value", ctypes.c_double),
        ("dropout_row_offset", ctypes.c_int64), ("dropout_key_offset", ctypes.c_int64), ("dropout_head_offset", ctypes.c_int64),
        ("partial_rows", ctypes.c_int64), ("sink", ctypes.c_int64),
        *((name, ctypes.c_int64) for name in ("threads", "block_rows", "block_keys", "value_slice", "chunks")),
        ("data", ctypes.c_void_p * len(BUFFERS)), ("numel", ctypes.c_int64 * len(BUFFERS)),
    ]

    def attach(self, name: str, t: Tensor | None) -> None:
        """Buffer `name` is contiguous `t` (None: null): bool for the mask, int64 for the key
        bounds, the call's element type for every other (the library checks element counts,
        not types)."""
        if t is not None and not t.is_contiguous():
            raise RuntimeError(f"attngrad's compiled tiles take contiguous buffers; {name} is not")
        element = {"mask": torch.bool, "key_bounds": torch.int64}.get(
            name, torch.float64 if self.double_precision else torch.float32)
        if t is not None and t.dtype != element:
            raise RuntimeError(f"attngrad's compiled tiles take {name} as {element}; got {t.dtype}")
        index = BUFFERS.index(name)
        if not hasattr(self, "tensors"):
            self.tensors = {}
        self.tensors[name] = t  # the call keeps its buffers alive: a converted copy has no other owner
        self.data[index] = None if t is None else t.data_ptr()
        self.numel[index] = 0 if t is None else t.numel()

    @classmethod
    def layout(cls) -> str:
        """The layout in the words of the library's attngrad_call_layout()."""
        fields = " ".join(f"{name}@{getattr(cls, name).offset}" for name, _ in cls._fields_)
        return f"{fields} size@{ctypes.sizeof(cls)} buffers:{','.join(BUFFERS)}"


def describe(q: Tensor, k: Tensor, v: Tensor, causal: int | None, scale: float, *, block_rows: int = 0,
             chunks: int = 1, seed: "int | Placement" = 0, dropout_p: float = 0.0, mask_sizes: tuple = (1, 1, 1, 1),
             bias_sizes: tuple = (1, 1, 1, 1), block_keys: int = 0, softcap: float = 0.0, sink: bool = False,
             **buffers: Tensor | None) -> AttentionCall:
    """The call of a pass on (B, H, Lq, d) q, (B, Hkv, Lk, d) k, (B, Hkv, Lk, dv) v, with the
    named `buffers` (contiguous; None or absent is null) and the options."""
    from .dropout import Placement, keep_value, threshold  # that module imports this one

    call = AttentionCall(*q.shape[:2], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    call.mask_sizes[:], call.bias_sizes[:] = mask_sizes, bias_sizes
    call.double_precision = q.dtype == torch.float64
    call.causal, call.causal_offset = causal is not None, 0 if causal is None else int(causal)
    bounds = buffers.get("key_bounds")
    call.bounds_batch = 1 if bounds is None else bounds.shape[0]
    call.scale, call.softcap = scale, softcap
    key = Placement.of(seed)
    call.dropout, call.seed = dropout_p > 0.0, key.seed
    call.dropout_row_offset, call.dropout_key_offset, call.dropout_head_offset = key.row_offset, key.key_offset, key.head_offset
    call.partial_rows, call.sink = key.partial_rows, sink
    call.threshold, call.keep_value = threshold(dropout_p), keep_value(dropout_p)
    call.threads = torch.get_num_threads()
    call.block_rows, call.block_keys, call.value_slice = block_rows or BLOCK_ROWS, block_keys or BLOCK_KEYS, VALUE_SLICE
    call.chunks = chunks
    for name, t in dict(q=q, k=k, v=v, **buffers).items():
        call.attach(name, t)
    return call


def _run(name: str, call: AttentionCall, bias_grad_into: str | None = None,
         bias: Tensor | None = None) -> Tensor | None:
    """Run pass `name` on `call`; with `bias_grad_into` (the buffer of a bias gradient's parts),
    first give it the zeroed parts the library asks for, and return their sum in the shape
    of `bias`."""
    parts = None
    if bias_grad_into is not None:
        count = library().attngrad_bias_grad_parts(ctypes.byref(call), bias_grad_into != "dbias_parts")
        dtype = torch.float64 if call.double_precision else torch.float32
        parts = torch.zeros(count, *call.bias_sizes, dtype=dtype)
        call.attach(bias_grad_into, parts)
    _call(name, call)
    return None if parts is None else _sum_parts(parts).view(bias.shape)


def _call(name: str, *args) -> None:
    """Call entry point `name` of the library; its size checks' refusal becomes a RuntimeError
    (the ops check first, so this means a bug in attngrad, never bad user input)."""
    lib = library()
    if getattr(lib, name)(*(ctypes.byref(a) if isinstance(a, AttentionCall) else a for a in args)) != 0:
        raise RuntimeError(f"attngrad's compiled tiles refused a call: {lib.attngrad_error().decode()}")


def supports(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None) -> bool:
    """Whether the tiles run a call, in any pass, with any dropout and with or without the
    bias's gradient: q, k, v on the CPU in one dtype (float16 and bfloat16 are computed in
    float32, the tiles' element type beside float64), no empty axis; a mask and a bias
    (broadcastable, any float dtype) on the CPU."""
    return (
        all(t is None or t.device.type == "cpu" for t in (mask, bias))
        and q.device.type == "cpu" and k.device.type == "cpu" and v.device.type == "cpu"
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        and k.dtype == q.dtype and v.dtype == q.dtype
        and min(q.shape) > 0 and min(k.shape) > 0 and min(v.shape) > 0
        and library() is not None
    )


def _buffers(*tensors: Tensor | None) -> tuple[list[int], ctypes.Array]:
    """The pointers of contiguous buffers (0 for None) and their element counts."""
    if any(t is not None and not t.is_contiguous() for t in tensors):
        raise RuntimeError("attngrad's compiled tiles take contiguous buffers")
    pointers = [0 if t is None else t.data_ptr() for t in tensors]
    return pointers, (ctypes.c_int64 * len(tensors))(*(0 if t is None else t.numel() for t in tensors))


def _work(*tensors: Tensor | None) -> list:
    """Each tensor contiguous in the tiles' element type: float64 stays, everything else is
    computed in float32 (float16 and bfloat16 inputs too; the ops return results in the
    inputs' own dtypes). None stays None."""
    work = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    return [None if t is None else t.to(work).contiguous() for t in tensors]


def _score_masks(mask: Tensor | None, bias: Tensor | None, dtype: torch.dtype, full_bias: bool = False,
                 bounds: Tensor | None = None) -> dict:
    """describe()'s mask and bias, each 4-D and contiguous in its own (broadcast) sizes, the
    bias in the compute dtype, and their sizes; and the key bounds, contiguous. An expanded
    axis (stride 0) is read as a broadcast one, except in the bias with `full_bias` (its
    gradient or tangent is wanted, which has its shape)."""
    described = {}
    if bounds is not None:
        described["key_bounds"] = bounds.contiguous()
    for name, t, kind in (("mask", mask, torch.bool), ("bias", bias, dtype)):
        if t is None:
            continue
        t = t[(None,) * (4 - t.dim())]
        for axis in range(4):
            if t.stride(axis) == 0 and t.shape[axis] > 1 and not (name == "bias" and full_bias):
                t = t.narrow(axis, 0, 1)
        described[name] = t = t.to(kind).contiguous()
        described[f"{name}_sizes"] = tuple(t.shape)
    return described


def _block_keys(bounds: Tensor | None) -> int:
    """Keys per block of the forward and backward: BLOCK_KEYS, or fewer where the key bounds
    leave every row a narrow band (a sliding window), whose tiles would otherwise be mostly
    excluded entries computed for nothing."""
    if bounds is None or bounds.numel() == 0:
        return BLOCK_KEYS
    widest = int((bounds[..., 1] - bounds[..., 0]).max())
    return BLOCK_KEYS if widest > NARROW_BAND else NARROW_BLOCK_KEYS


def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: int | None, scale: float, softcap: float = 0.0,
                      mask: Tensor | None = None, bias: Tensor | None = None, seed: "int | Placement" = 0,
                      dropout_p: float = 0.0, bounds: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(out (B, H, Lq, dv), row max m, inverse row sum 1/l (B, H, Lq)): `kernels.attention_forward`'s results."""
    q, k, v = _work(q, k, v)
    batch, heads, len_q, _ = q.shape
    out = q.new_empty(batch, heads, len_q, v.shape[-1])
    row_max, inv_sum = q.new_empty(batch, heads, len_q), q.new_empty(batch, heads, len_q)
    _call("attngrad_forward", describe(q, k, v, causal, scale, softcap=softcap, seed=seed, dropout_p=dropout_p, out=out,
                                       row_max=row_max, inv_sum=inv_sum, block_keys=_block_keys(bounds),
                                       **_score_masks(mask, bias, q.dtype, bounds=bounds)))
    return out, row_max, inv_sum


# Work items a backward pass aims for. The count follows the shapes alone, never the thread
# count, so the bits do not either. Each extra chunk costs a partial dQ (or dK, dV) the size
# of the gradient: 8 items keep B H = 8 at one chunk, so its memory stays at a few MiB, for
# 4-8% of backward time on 2 threads (B=1, H=8, L=4096: 680 ms against 651 full, 386 against
# 355 causal, with 2 chunks).
TARGET_ITEMS = 8


def _chunks(batch_kv_heads: int, blocks: int) -> int:
    """Work items of the backward passes are (batch, key/value head, chunk of blocks); each
    chunk sums its own copy of the gradients its blocks share, and the copies are added in
    chunk order. One chunk when there are TARGET_ITEMS heads or more; otherwise enough
    chunks for about TARGET_ITEMS items, no more than the blocks."""
    if batch_kv_heads >= TARGET_ITEMS:
        return 1
    return max(1, min(blocks, -(-TARGET_ITEMS // batch_kv_heads)))


def _independent(k: Tensor, bias_sizes: tuple | None) -> int:
    """How many (b, key/value head) work items a backward pass can run apart: all of them,
    except that the tiles give one item the batch entries or heads whose gradient of a
    broadcast bias (of 4-D `bias_sizes`, None without a gradient) adds into the same entries."""
    batch, kv_heads = k.shape[:2]
    if bias_sizes is None:
        return batch * kv_heads
    return (1 if bias_sizes[0] == 1 else batch) * (1 if bias_sizes[1] == 1 else kv_heads)


def _whole_row_split(q: Tensor, k: Tensor, masks: dict, bias_grad: bool, chunks: int | None) -> tuple[int, int]:
    """(rows per query block, chunks) of a pass on whole rows (JVP, the backward's JVP,
    double backward): `chunks` as given, or enough for its independent work items."""
    rows = _rows_per_block(k.shape[2])
    if chunks is None:
        chunks = _chunks(_independent(k, masks["bias_sizes"] if bias_grad else None), -(-q.shape[2] // rows))
    return rows, chunks


def _with_bias_like(masks: dict, name: str, t: Tensor | None, dtype: torch.dtype) -> dict:
    """`masks` with `t`, a tangent or cotangent of the bias, as buffer `name` in the bias's
    4-D sizes (absent where `t` is None)."""
    if t is not None:
        masks[name] = t.to(dtype).reshape(masks["bias_sizes"]).contiguous()
    return masks


def _sum_parts(parts: Tensor) -> Tensor:
    """parts[0] + parts[1] + ... in that order (a reduction kernel might pair them otherwise)."""
    if len(parts) == 1:
        return parts[0]
    total = parts[0] + parts[1]
    for part in parts[2:]:
        total += part
    return total


def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, row_max: Tensor, inv_sum: Tensor,
    causal: int | None, scale: float, chunks: int | None = None, mask: Tensor | None = None, bias: Tensor | None = None,
    seed: "int | Placement" = 0, dropout_p: float = 0.0, bias_grad: bool = False, bounds: Tensor | None = None, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dbias or None): `kernels.attention_backward`'s results for the cases
    `supports` accepts; dbias in the bias's shape and the compute dtype. `chunks` splits
    each head's keys into that many work items (default: `_chunks`)."""
    dout, q, k, v, out, row_max, inv_sum = _work(dout, q, k, v, out, row_max, inv_sum)
    masks = _score_masks(mask, bias, q.dtype, full_bias=bias_grad, bounds=bounds)
    block_keys = _block_keys(bounds)
    if chunks is None:
        chunks = _chunks(_independent(k, masks["bias_sizes"] if bias_grad else None), -(-k.shape[2] // block_keys))
    dq_parts = q.new_zeros(chunks, *q.shape)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    delta = q.new_empty(q.shape[:-1])
    call = describe(q, k, v, causal, scale, chunks=chunks, seed=seed, dropout_p=dropout_p, softcap=softcap, dout=dout, out=out,
                    row_max=row_max, inv_sum=inv_sum, delta=delta, dq_parts=dq_parts, dk=dk, dv=dv,
                    block_keys=block_keys, **masks)
    dbias = _run("attngrad_backward", call, "dbias_parts" if bias_grad else None, bias)
    return _sum_parts(dq_parts), dk, dv, dbias


def _rows_per_block(len_k: int) -> int:
    """Query rows per block of the double backward, which holds four R x Lk' tiles of whole
    rows: at most DOUBLE_TILE numbers each, 8 (or BLOCK_ROWS if fewer) to BLOCK_ROWS rows."""
    return max(min(8, BLOCK_ROWS), min(BLOCK_ROWS, DOUBLE_TILE // max(1, len_k)))


def attention_double_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, row_max: Tensor, inv_sum: Tensor,
    causal: int | None, scale: float, dout_grad: bool, gq: Tensor | None, gk: Tensor | None, gv: Tensor | None,
    chunks: int | None = None, mask: Tensor | None = None, bias: Tensor | None = None, gbias: Tensor | None = None,
    seed: "int | Placement" = 0, dropout_p: float = 0.0, bias_grad: bool = False, bounds: Tensor | None = None, softcap: float = 0.0,
    sink: bool = False,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor | None]:
    """(g_dout or None, g_q, g_k, g_v, g_bias or None): `kernels_higher.attention_double_backward`'s
    results for the cases `supports` accepts, in the compute dtype; an absent cotangent is
    zero (`gbias`, dbias's, only with `bias_grad`). `chunks` splits each head's query blocks
    into that many work items (default: `_chunks`)."""
    dout, q, k, v, out, row_max, inv_sum, gq, gk, gv = _work(dout, q, k, v, out, row_max, inv_sum, gq, gk, gv)
    masks = _score_masks(mask, bias, q.dtype, full_bias=bias_grad, bounds=bounds)
    _with_bias_like(masks, "gbias", gbias if bias_grad else None, q.dtype)
    rows, chunks = _whole_row_split(q, k, masks, bias_grad, chunks)
    g_dout = torch.empty_like(dout) if dout_grad else None
    g_q = torch.empty_like(q)
    gk_parts, gv_parts = k.new_zeros(chunks, *k.shape), v.new_zeros(chunks, *v.shape)
    call = describe(q, k, v, causal, scale, block_rows=rows, chunks=chunks, seed=seed, dropout_p=dropout_p, dout=dout,
                    softcap=softcap, sink=sink, out=out, row_max=row_max, inv_sum=inv_sum, delta=q.new_empty(q.shape[:-1]), gq=gq, gk=gk, gv=gv,
                    g_dout=g_dout, g_q=g_q, gk_parts=gk_parts, gv_parts=gv_parts, **masks)
    g_bias = _run("attngrad_double_backward", call, "g_bias_parts" if bias_grad else None, bias)
    return g_dout, g_q, _sum_parts(gk_parts), _sum_parts(gv_parts), g_bias


def dropout_keep_scale_into(out: Tensor, seed: int, row_start: int, threshold: int, value: float,
                            key_start: int = 0) -> Tensor:
    """`dropout.keep_scale_into` for a contiguous float32 or float64 CPU tile (B, H, R, keys)."""
    pointers, _ = _buffers(out)
    _call("attngrad_dropout_keep_scale", out.dtype == torch.float64, pointers[0], out.numel(), *out.shape[:2], row_start,
          out.shape[2], key_start, out.shape[3], seed, threshold, value, torch.get_num_threads())
    return out


def attention_jvp(q: Tensor, k: Tensor, v: Tensor, row_max: Tensor, inv_sum: Tensor, causal: int | None, scale: float,
                  tq: Tensor | None, tk: Tensor | None, tv: Tensor | None, mask: Tensor | None = None,
                  bias: Tensor | None = None, tbias: Tensor | None = None, seed: "int | Placement" = 0,
                  dropout_p: float = 0.0, bounds: Tensor | None = None, softcap: float = 0.0) -> Tensor:
    """The output's tangent (B, H, Lq, dv): `kernels_higher.attention_jvp`'s result for the
    cases `supports` accepts; an absent tangent is zero."""
    q, k, v, row_max, inv_sum, tq, tk, tv = _work(q, k, v, row_max, inv_sum, tq, tk, tv)
    masks = _with_bias_like(_score_masks(mask, bias, q.dtype, full_bias=tbias is not None, bounds=bounds), "tbias",
                            tbias, q.dtype)
    out_t = q.new_empty(*q.shape[:3], v.shape[-1])
    rows, chunks = _whole_row_split(q, k, masks, False, None)  # each work item owns its rows
    _call("attngrad_jvp", describe(q, k, v, causal, scale, block_rows=rows, chunks=chunks, seed=seed, softcap=softcap,
                                   dropout_p=dropout_p, row_max=row_max, inv_sum=inv_sum, tq=tq, tk=tk, tv=tv,
                                   tout=out_t, **masks))
    return out_t


def attention_backward_jvp(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, row_max: Tensor, inv_sum: Tensor,
    causal: int | None, scale: float, tdout: Tensor | None, tq: Tensor | None, tk: Tensor | None, tv: Tensor | None,
    mask: Tensor | None = None, bias: Tensor | None = None, tbias: Tensor | None = None, seed: "int | Placement" = 0,
    dropout_p: float = 0.0, bias_grad: bool = False, chunks: int | None = None, bounds: Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The tangents of (dq, dk, dv, dbias or None): `kernels_higher.attention_backward_jvp`'s
    results for the cases `supports` accepts, in the compute dtype; an absent tangent is
    zero. `chunks` splits each head's query blocks into that many work items (default:
    `_chunks`)."""
    dout, q, k, v, out, row_max, inv_sum, tdout, tq, tk, tv = _work(dout, q, k, v, out, row_max, inv_sum, tdout, tq,
                                                                    tk, tv)
    masks = _score_masks(mask, bias, q.dtype, full_bias=bias_grad or tbias is not None, bounds=bounds)
    _with_bias_like(masks, "tbias", tbias, q.dtype)
    rows, chunks = _whole_row_split(q, k, masks, bias_grad, chunks)
    tdq = q.new_empty(q.shape)
    tdk_parts, tdv_parts = k.new_zeros(chunks, *k.shape), v.new_zeros(chunks, *v.shape)
    call = describe(q, k, v, causal, scale, block_rows=rows, chunks=chunks, seed=seed, dropout_p=dropout_p, dout=dout,
                    softcap=softcap, out=out, row_max=row_max, inv_sum=inv_sum, delta=q.new_empty(q.shape[:-1]), tdout=tdout, tq=tq,
                    tk=tk, tv=tv, tdq=tdq, tdk_parts=tdk_parts, tdv_parts=tdv_parts, **masks)
    tdbias = _run("attngrad_backward_jvp", call, "tdbias_parts" if bias_grad else None, bias)
    return tdq, _sum_parts(tdk_parts), _sum_parts(tdv_parts), tdbias
