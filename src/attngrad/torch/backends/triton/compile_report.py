"""Every Triton kernel variant compiled ahead of time for NVIDIA GPUs, without one: the
launches `launch` would make for a set of calls are recorded (on small CPU stand-ins, with
each target's tile sizes), specialised as Triton's JIT would specialise them, and compiled
to PTX and a cubin for that target (sm_80: A100, sm_90: H100); the registers and spills are
those of Triton's own ptxas run (its -v log, with Triton's flags), the shared memory
Triton's metadata.

    rows = compile_report(dtypes=("bfloat16",), widths=(128,), archs=(80, 90))
    [r for r in rows if r.spill_bytes]   # what spills, and how much

`attngrad gpu-report` prints the table; docs/gpu.md holds one. This module imports triton
only when it compiles: its constants serve the command line's help.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...masks import blocks as mask_blocks
from ...op.call import AttentionCall, HvpSums, ScoreMasks
from ...precision import compute_dtype

PASSES = ("forward", "backward", "jvp", "forward_jvp", "backward_jvp", "double_backward")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float32-tf32": torch.float32, "float32-tf32x3": torch.float32, "float32-bf16x6": torch.float32,
          "float64": torch.float64}
# float32 dtypes' products on the tensor cores, by name (Triton's input_precision)
PRODUCTS = {"float32-tf32": "tf32", "float32-tf32x3": "tf32x3", "float32-bf16x6": "bf16x6"}
WIDTHS = (64, 128, 256)
ARCHS = (80, 90)
# What each feature set turns on: "plain" nothing; "all" every option that adds code to a
# kernel (boolean mask, a mask kept per block, a bias with the scores' shape and its gradient,
# key bounds, the causal diagonal, soft cap, dropout, GQA, every tangent and cotangent); "broadcast-bias"
# the same with a (1, H, 1, Lk) bias, whose gradient the bias-side kernel reduces; "light"
# the options a light call may have (`config.is_light`: key bounds, the causal diagonal, GQA),
# which take sm_90's own tiles in half precision.
FEATURES = ("plain", "all", "broadcast-bias", "light")
# Where a spill fails the check: head widths up to 128 in float16, bfloat16 and float32.
NO_SPILL_WIDTH = 128
NO_SPILL_DTYPES = ("float16", "bfloat16", "float32", "float32-tf32")  # the split products are opt-in, untimed


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the pass it belongs to, the kernel, its arguments in
    order, those passed by name (the constexprs among them) and its launch options."""

    pass_name: str
    kernel: Any
    args: tuple
    constexprs: dict
    options: dict


@dataclass(frozen=True)
class Row:
    """One variant compiled for one target."""

    kernel: str
    pass_name: str
    features: str
    dtype: str
    width: int
    arch: int
    block: str  # "BMxBN wW sS /S rN": the tile, warps, pipeline stages, head-width slice, registers
    registers: Optional[int] = None
    spill_bytes: Optional[int] = None  # spill stores + spill loads
    shared_bytes: Optional[int] = None
    seconds: float = 0.0
    error: Optional[str] = None

    @property
    def must_not_spill(self) -> bool:
        return self.width <= NO_SPILL_WIDTH and self.dtype in NO_SPILL_DTYPES

    @property
    def failed(self) -> bool:
        return self.error is not None or (self.must_not_spill and bool(self.spill_bytes))


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch, under the
    pass named last in `into` (a list whose first item is a one-item list: the pass)."""

    def __init__(self, kernel, into: list) -> None:
        self.kernel, self.into = kernel, into

    def __getitem__(self, grid) -> Callable[..., None]:
        def record(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")
                       if k in kwargs}
            self.into.append(Launch(self.into[0][0], self.kernel, args, kwargs, options))

        return record


@contextlib.contextmanager
def _recording(into: list, products: str, arch: int) -> Iterator[None]:
    """Launches recorded instead of run, with the tiles of a GPU of compute capability
    `arch` (and TF32 for float32 if asked)."""
    from . import kernels, launch

    names = ("forward", "jvp", "forward_jvp", "row_sums", "given_row_sums", "query_side", "key_side", "bias_side",
             "row_dot", "key_side_light")
    saved = (launch.kernels, launch.on_gpu, launch.input_precision, launch.arch_of)
    launch.kernels = types.SimpleNamespace(**{n: _Recorder(getattr(kernels, n), into) for n in names})
    launch.on_gpu = lambda call: True
    launch.arch_of = lambda device: arch
    if products != "ieee":
        launch.input_precision = lambda dtype, device: products if dtype == torch.float32 else "ieee"
    try:
        yield
    finally:
        launch.kernels, launch.on_gpu, launch.input_precision, launch.arch_of = saved


def _call(dtype: torch.dtype, width: int, features: str) -> tuple[AttentionCall, dict]:
    """A CPU stand-in call (its sizes matter only to the specialisation) and the pass inputs."""
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length = 2, 4, 2, 256

    def rand(*shape, kind=dtype):
        return torch.randn(*shape, generator=gen).to(kind)

    if features == "plain":  # no option, no GQA
        kv_heads = heads
    q, k, v = (rand(batch, h, length, width) for h in (heads, kv_heads, kv_heads))
    if features == "plain":
        return AttentionCall(q, k, v, ScoreMasks(), torch.tensor(0), width ** -0.5), {}
    bounds = torch.tensor([[[0, length]] * length], dtype=torch.int64)
    if features == "light":
        tangents = dict(tq=rand(*q.shape), tk=rand(*k.shape), tv=rand(*v.shape))
        return AttentionCall(q, k, v, ScoreMasks(bounds=bounds, causal=0), torch.tensor(0), width ** -0.5), tangents
    bias_shape = (batch, heads, length, length) if features == "all" else (1, heads, 1, length)
    blocks = mask_blocks.from_dense(rand(1, heads, length, length, kind=torch.float32) > 0, (64, 64))
    masks = ScoreMasks(mask=rand(batch, 1, length, length, kind=torch.float32) > 0, bias=rand(*bias_shape),
                       bounds=bounds, causal=0, softcap=30.0, blocks=blocks)
    call = AttentionCall(q, k, v, masks, torch.tensor(5), width ** -0.5, 0.1)
    tangents = dict(tq=rand(*q.shape), tk=rand(*k.shape), tv=rand(*v.shape), tbias=rand(*bias_shape))
    return call, tangents


def record_launches(dtype: torch.dtype, width: int, features: str, products: str = "ieee",
                    passes: Sequence[str] = PASSES, arch: int = 90) -> list[Launch]:
    """The launches of the given passes of one call on a GPU of compute capability `arch`:
    forward, backward with the bias gradient, JVP, the forward with its JVP, the backward's
    JVP and the double backward (with g_dO); the forward with its JVP and the backward's JVP
    also as a Hessian-vector product runs them, the one leaving the other its row sums."""
    from . import launch

    call, t = _call(dtype, width, features)
    rows = torch.zeros(call.q.shape[:3], dtype=compute_dtype(dtype))
    out = torch.zeros(*call.q.shape[:3], call.v.shape[-1], dtype=dtype)
    stats = dict(dout=out, out=out, row_max=rows, inv_sum=rows, bias_grad=call.bias is not None)
    tangents = dict(tq=t.get("tq"), tk=t.get("tk"), tv=t.get("tv"), tbias=t.get("tbias"))
    sums = HvpSums(centre_sums=rows[..., None], peak_sums=rows[..., None],
                   peak_index=torch.zeros(*rows.shape, 1, dtype=torch.int32))  # an HVP's (`hvp_fusion.ForwardSums`)
    runs = {
        "forward": lambda: launch.forward(call),
        "backward": lambda: launch.backward(call, **stats),
        "jvp": lambda: launch.jvp(call, row_max=rows, inv_sum=rows, **tangents),
        "forward_jvp": lambda: (launch.forward_jvp(call, **tangents),
                                launch.forward_jvp(call, **tangents, row_sums=HvpSums(sums, results=(out, rows, rows)))),
        "backward_jvp": lambda: (launch.backward_jvp(call, **stats, tdout=out if t else None, **tangents),
                                 launch.backward_jvp(call, **stats, tdout=out if t else None, **tangents,
                                                     row_sums=HvpSums(centre=sums["centre_sums"], peak=sums["peak_sums"],
                                                                      peak_index=sums["peak_index"], out_t=out))),
        "double_backward": lambda: launch.double_backward(call, **stats, dout_grad=True, gq=t.get("tq"),
                                                          gk=t.get("tk"), gv=t.get("tv"), gbias=t.get("tbias")),
    }
    into: list = [[""]]
    with _recording(into, products, arch):
        for name in passes:
            into[0][0] = name
            runs[name]()
    return into[1:]


def _bound(record: Launch) -> dict:
    """The launch's arguments by parameter name, defaults filled in."""
    bound = record.kernel.signature.bind(*record.args, **record.constexprs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _named_constexprs(record: Launch) -> dict:
    """The constexpr parameters' values by name, a `tile_ops.Switches` spread into its fields."""
    values = _bound(record)
    named = {p.name: values[p.name] for p in record.kernel.params if p.is_constexpr}
    switches = named.pop("SW", None)
    return {**named, **(switches._asdict() if switches is not None else {})}


def _specialise(record: Launch, backend) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as Triton's JIT makes them for these arguments: a tuple
    argument's kind is the tuple of its items' kinds, and its constexprs (a None, an integer
    1) and attributes (16-byte alignment, divisibility by 16) are keyed by their path,
    (parameter index, item index, ...), as those of a lone argument are by (index,)."""
    from triton._C.libtriton import native_specialize_impl
    from triton._utils import find_paths_if, get_iterable_path
    from triton.backends.compiler import BaseBackend

    fn = record.kernel
    values = list(_bound(record).values())
    kinds, specs = [], []
    for param, value in zip(fn.params, values):
        kind, spec = ("constexpr", "") if param.is_constexpr else native_specialize_impl(BaseBackend, value, False,
                                                                                          True, True)
        kinds.append(kind)
        specs.append(spec)
    signature = {param.name: kind for param, kind in zip(fn.params, kinds)}
    constexprs = {path: get_iterable_path(values, path) for path in find_paths_if(kinds, lambda _, k: k == "constexpr")}
    attrs = {path: backend.parse_attr(get_iterable_path(specs, path))
             for path in find_paths_if(specs, lambda _, spec: isinstance(spec, str))}
    return signature, constexprs, attrs


_PTXAS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_report(log: str) -> tuple[int, int]:
    """(registers, spill bytes) from a ptxas -v log."""
    registers, spills = _PTXAS.search(log), _SPILLS.search(log)
    if registers is None or spills is None:
        raise RuntimeError(f"no ptxas -v report in Triton's compile log (has Triton stopped printing it?): {log[-300:]!r}")
    stores, loads = (int(x) for x in spills.groups())
    return int(registers.group(1)), stores + loads


def compile_launch(record: Launch, arch: int) -> tuple[int, int, int]:
    """Compile one recorded launch for sm_<arch>: (registers, spill bytes, shared memory bytes).
    The figures are those of the cubin Triton builds: Triton's ptxas log, which it prints
    when asked (`dump_ptxas_log`), read back, from a compile that skips Triton's cache (a
    cached kernel runs no ptxas). Running ptxas again apart from Triton measured another
    build: its flags differ from Triton's, and from one Triton release to the next."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    signature, constexprs, attrs = _specialise(record, backend)
    source = ASTSource(record.kernel, signature, constexprs, attrs)
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(source, target=target, options=dict(record.options))
    registers, spills = _ptxas_report(log.getvalue())
    return registers, spills, int(compiled.metadata.shared)


def _block_label(record: Launch) -> str:
    """"BMxBN wW sS" (" tma" where the walks load through tensor descriptors), then "/S" where the products take S columns of the head width at a
    time, and "rN" where ptxas is allowed N registers."""
    c, options = _named_constexprs(record), record.options
    tile = f"{c['BM']}x{c['BN']}" if "BN" in c else f"{c['BM']} rows"
    label = f"{tile} w{options['num_warps']} s{options['num_stages']}" + (" tma" if c.get("TMA") else "")
    if "SD" in c and (c["SD"] < c["BD"] or c["SDV"] < c["BDV"]):
        label += f" /{min(c['SD'], c['SDV'])}"
    if options.get("maxnreg"):
        label += f" r{options['maxnreg']}"
    return label


def compile_report(dtypes: Sequence[str] = tuple(DTYPES), widths: Sequence[int] = WIDTHS,
                   archs: Sequence[int] = ARCHS, features: Sequence[str] = FEATURES,
                   passes: Sequence[str] = PASSES, progress: Optional[Callable[[Row], None]] = None,
                   tensor_descriptors: bool = False) -> list[Row]:
    """Every distinct kernel variant of the given calls, compiled for every target with the
    target's tiles (with `tensor_descriptors`, the walks' loads through TMA where
    `launch._descriptors` takes them: sm_90)."""
    from . import config

    with config.TUNING.override(tensor_descriptors=tensor_descriptors):
        return _compile_all(dtypes, widths, archs, features, passes, progress)


def _compile_all(dtypes: Sequence[str], widths: Sequence[int], archs: Sequence[int], features: Sequence[str],
                 passes: Sequence[str], progress: Optional[Callable[[Row], None]]) -> list[Row]:
    rows = []
    for dtype_name in dtypes:
        for width in widths:
            seen = set()
            for feature in features:
                for arch in archs:
                    for record in record_launches(DTYPES[dtype_name], width, feature,
                                                  products=PRODUCTS.get(dtype_name, "ieee"), passes=passes,
                                                  arch=arch):
                        key = (arch, record.kernel.__name__, str(record.options),
                               tuple(sorted((k, str(v)) for k, v in _named_constexprs(record).items())))
                        if key in seen:
                            continue
                        seen.add(key)
                        block = _block_label(record)
                        start = time.perf_counter()
                        fields = dict(kernel=record.kernel.__name__, pass_name=record.pass_name, features=feature,
                                      dtype=dtype_name, width=width, arch=arch, block=block)
                        try:
                            registers, spills, shared = compile_launch(record, arch)
                            row = Row(**fields, registers=registers, spill_bytes=spills, shared_bytes=shared,
                                      seconds=time.perf_counter() - start)
                        except Exception as error:  # a variant that does not compile is a result
                            message = str(error).strip().splitlines()
                            row = Row(**fields, seconds=time.perf_counter() - start,
                                      error=f"{type(error).__name__}: {message[-1] if message else ''}"[:300])
                        rows.append(row)
                        if progress is not None:
                            progress(row)
    return rows
