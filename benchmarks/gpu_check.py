"""The Triton backend on a real GPU: every pass against float64, then its speed against
PyTorch's own kernels. A program for a machine with CUDA (one short run of a lent GPU).

    python benchmarks/gpu_check.py check --workers 12   # every pass, dtype and feature set
    python benchmarks/gpu_check.py time                 # speed, interleaved with PyTorch's
    python benchmarks/gpu_check.py all --out DIR        # both, with JSON lines in DIR

`check` runs every derivative the backend has (output, gradients with the bias or sinks,
JVP, double backward with dO's, forward-over-reverse HVP) at shapes no tile divides, with
the GPU's own tiles (`launch.blocks_for`; the interpreter's tests take 16 x 16 and 32 x 32
only). Each
result's error against the float64 math path, max|ours - truth| / max|truth|, is printed
beside PyTorch's math path's in the same dtype (for float64 the bar is 1e-12). It also
checks that a second run gives the same bits and that the dropout mask is the CPU's, bit
for bit. Kernels compile in worker processes (Triton's compiler is single-threaded and
its on-disk cache is shared), so a cold run takes minutes, not tens of minutes.

`time` takes each case's median over interleaved rounds (`triton.testing.do_bench`, CUDA
events), ours and PyTorch's on the same inputs, and the peak memory beyond the inputs.
PyTorch's default backend is the yardstick where it runs a case (flash or cuDNN for half
precision, memory-efficient for a float bias with its gradient); its math path where only
it does (JVP and second order). Each call is timed between two events on an idle stream,
so its host-side work (dispatch, the plan) is inside the figure.

With `--interpret` the check runs on CPU tensors in Triton's interpreter with the tiles of
the GPU `--arch` names, at small shapes: a dry run of the program and of the tiles'
numerics without a GPU (`--workers` is then 1, and float64 at 16 x 16 takes minutes a set).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Optional

DOUBLE = "float64"
DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16")
# float32 with split products on the tensor cores (`config.Options.float32_products`): opt-in
SPLIT = ("tf32x3", "bf16x6")


@dataclass(frozen=True)
class Features:
    """One feature set: the shape and the options of a call."""

    name: str
    len_q: int
    len_k: int
    causal: bool | str = False
    mask: bool = False
    bias: Optional[str] = None  # "scores" (B, H, Lq, Lk), "heads" (H, Lq, Lk), "keys" (B, 1, 1, Lk), "row" (1, H, 1, Lk)
    softcap: float = 0.0
    sinks: bool = False
    window: Optional[tuple] = None
    documents: bool = False
    padding: bool = False
    dropout_p: float = 0.0


# B = 2, H = 4 over Hkv = 2 (GQA) in every set; lengths that no tile divides
FEATURES = (
    Features("plain", 300, 517),
    Features("causal", 517, 517, causal=True),
    Features("bottom-right-softcap-row-bias", 300, 517, causal="bottom_right", softcap=20.0, bias="row"),
    Features("causal-mask-bias", 300, 517, causal=True, mask=True, bias="heads"),
    Features("scores-bias", 300, 517, bias="scores"),
    Features("window-sinks", 517, 517, causal=True, window=(100, None), sinks=True),
    Features("documents-padding", 517, 517, documents=True, padding=True),
    Features("dropout-key-bias", 300, 517, causal=True, bias="keys", dropout_p=0.2),
)
SMALL = {"plain": (37, 83), "causal": (83, 83), "window-sinks": (83, 83), "documents-padding": (83, 83)}


def torch_dtype(name: str):
    import torch

    return torch.float32 if name in ("tf32", *SPLIT) else getattr(torch, name)


def randn(shape, seed, device, dtype=None):
    import torch

    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return t.to(device=device, dtype=dtype or torch.float64)


class Call:
    """Inputs (float64) and two functions of them: attngrad's and the math path's."""

    def __init__(self, f: Features, d: int, device: str, small: bool = False) -> None:
        import torch

        from attngrad.torch.op import dropout

        self.f, self.device = f, device
        B, H, HKV = 2, 4, 2
        lq, lk = SMALL.get(f.name, (37, 83)) if small else (f.len_q, f.len_k)
        self.q = randn((B, H, lq, d), 1, device)
        self.k, self.v = randn((B, HKV, lk, d), 2, device), randn((B, HKV, lk, d), 3, device)
        shapes = {"scores": (B, H, lq, lk), "heads": (H, lq, lk), "keys": (B, 1, 1, lk), "row": (1, H, 1, lk)}
        self.extra = randn(shapes[f.bias], 4, device) if f.bias else randn((H,), 4, device) if f.sinks else None
        i, j = torch.arange(lq, device=device)[:, None], torch.arange(lk, device=device)[None, :]
        offset = lk - lq if f.causal == "bottom_right" else 0
        allowed = torch.ones(B, 1, lq, lk, dtype=torch.bool, device=device)
        self.options = dict(is_causal=f.causal, softcap=f.softcap or None, enable_gqa=True)
        if f.causal:
            allowed &= j <= i + offset
        if f.mask:
            mask = randn((B, 1, lq, lk), 5, device) > -0.7
            mask[..., 0] = True
            self.options["attn_mask"] = mask
            allowed &= mask
        if f.window:
            self.options["window"] = f.window
            allowed &= j >= i + offset - f.window[0]
        if f.documents:
            ids = torch.tensor([0] * (lq // 3) + [1] * (lq // 3) + [2] * (lq - 2 * (lq // 3)), device=device)
            self.options["document_ids"] = ids
            allowed &= ids[:, None] == ids[None, :]
        if f.padding:
            lengths = torch.tensor([lk - 3, lk - lk // 4], device=device)
            self.options["key_padding"] = lengths
            allowed &= j < lengths[:, None, None, None]
        self.allowed, self.keep, self.seed = allowed, None, 20261127
        if f.dropout_p:
            self.keep = dropout.keep_scale_torch(torch.empty(B, H, lq, lk, dtype=torch.float64), self.seed, 0,
                                                 f.dropout_p).to(device) > 0

    @property
    def primals(self) -> tuple:
        return (self.q, self.k, self.v) + (() if self.extra is None else (self.extra,))

    def ours(self, q, k, v, extra=None):
        import torch

        from attngrad.torch import attention
        from attngrad.torch.op.autograd import attention as differentiable
        from attngrad.torch.op.call import AttentionCall, ScoreMasks

        if self.f.dropout_p:  # the op itself, to give the seed
            causal = {False: None, True: 0, "bottom_right": k.shape[2] - q.shape[2]}[self.f.causal]
            masks = ScoreMasks(mask=None, bias=extra, bounds=None, causal=causal, softcap=0.0, sink=False, blocks=None)
            call = AttentionCall(q, k, v, masks,
                                 torch.tensor(self.seed), q.shape[-1] ** -0.5, self.f.dropout_p)
            return differentiable(call)
        options = dict(self.options)
        if self.f.bias:
            options["attn_bias"] = extra
        if self.f.sinks:
            options["sinks"] = extra
        return attention(q, k, v, **options)

    def theirs(self, q, k, v, extra=None):
        import torch

        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if self.f.softcap:
            s = self.f.softcap * torch.tanh(s / self.f.softcap)
        if self.f.bias:
            s = s + extra
        s = s.masked_fill(~self.allowed, float("-inf"))
        if self.f.sinks:
            s = torch.cat([s, extra[:, None, None].to(s.dtype).expand(*s.shape[:-1], 1)], -1)
        p = torch.softmax(s, -1)
        if self.f.sinks:
            p = p[..., :-1]
        if self.keep is not None:
            p = p * self.keep / (1 - self.f.dropout_p)
        return p @ v


def error(x, truth) -> float:
    import torch

    x, truth = x.double(), truth.double()
    if not torch.isfinite(x).all():
        return float("nan")
    scale = float(truth.abs().max()) if truth.numel() else 0.0
    return float((x - truth).abs().max()) / (scale or 1.0)


@dataclass
class Row:
    features: str
    dtype: str
    d: int
    errors: dict = field(default_factory=dict)  # result -> (ours, PyTorch math in the dtype)
    same_bits: Optional[bool] = None
    failure: str = ""
    seconds: float = 0.0


def _zero_gradients(f: Features) -> set:
    """0 in exact arithmetic (a bias constant along the keys): rounding noise on both sides."""
    return {"dextra", "gg_extra", "hvp_extra", "rof_extra", "rof_textra"} if f.bias == "keys" else set()


def check_one(job: tuple) -> Row:
    features_name, dtype_name, d, device, small = job
    import torch

    from attngrad.check.torch_backend import every_derivative
    from attngrad.torch import use_backend
    from attngrad.torch.backends.triton import launch

    f = next(x for x in FEATURES if x.name == features_name)
    row, start = Row(f.name, dtype_name, d), time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
    try:
        call = Call(f, d, device, small)
        truth = every_derivative(call.theirs, call.primals, 30)
        dtype = torch_dtype(dtype_name)
        inputs = tuple(p.to(dtype) if p.is_floating_point() else p for p in call.primals)
        products = dtype_name if dtype_name in SPLIT else "ieee"
        with use_backend("triton"), launch.TUNING.override(float32_products=products):
            ours = every_derivative(call.ours, inputs, 30)
            again = every_derivative(call.ours, inputs, 30)
        yardstick = every_derivative(call.theirs, inputs, 30) if dtype_name != DOUBLE else {}
        row.same_bits = all(torch.equal(ours[n], again[n]) for n in ours)
        zeros = _zero_gradients(f)
        for name, t in truth.items():
            ours_error = error(ours[name], t)
            theirs_error = error(yardstick[name], t) if yardstick else 0.0
            if name in zeros:  # against the largest result's scale
                scale = max(float(x.abs().max()) for x in truth.values())
                ours_error = float((ours[name].double() - t).abs().max()) / scale
                theirs_error = float((yardstick[name].double() - t).abs().max()) / scale if yardstick else 0.0
            row.errors[name] = (ours_error, theirs_error)
    except Exception:  # noqa: BLE001  (one failing set must not end the run)
        row.failure = traceback.format_exc(limit=6)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    row.seconds = time.perf_counter() - start
    return row


def dropout_bits(device: str) -> bool:
    """Q = 0 and V = I make O * Lk the keep-scale of every score: the GPU's draws against
    dropout.py's (PyTorch operators, on the CPU), at a whole call and at an offset placement."""
    import torch

    from attngrad.torch import use_backend
    from attngrad.torch.op import dropout
    from attngrad.torch.op.autograd import attention as differentiable
    from attngrad.torch.op.call import AttentionCall, ScoreMasks

    lk, p = 64, 0.5  # P = 1/64 and Z = 2: O = Z / 64 exactly in float32
    q = torch.zeros(2, 3, 200, 16, dtype=torch.float32, device=device)
    k = randn((2, 3, lk, 16), 1, device, torch.float32)
    v = torch.eye(lk, dtype=torch.float32, device=device).expand(2, 3, lk, lk)
    same = True
    for placement in (dropout.Placement(987654321987), dropout.Placement(-5, 7, 3, 2)):
        masks = ScoreMasks(mask=None, bias=None, bounds=None, causal=None, softcap=0.0, sink=False, blocks=None)
        with use_backend("triton"):
            out = differentiable(AttentionCall(q, k, v, masks, placement.tensor(), 0.25, p))
        expected = dropout.keep_scale_torch(torch.empty(2, 3, 200, lk, dtype=torch.float32), placement.seed,
                                            placement.row_offset, p, placement.key_offset, placement.head_offset)
        same &= torch.equal((out * lk).cpu(), expected)
    return same


def report_dropout_bits(device: str) -> bool:
    try:
        bits = dropout_bits(device)
    except Exception:  # noqa: BLE001
        print(f"dropout bits FAILED:\n{traceback.format_exc(limit=6)}", flush=True)
        return False
    print(f"dropout mask equals dropout.py's bit for bit: {bits}", flush=True)
    return bits


def run_check(workers: int, device: str, small: bool, widths: tuple, dtypes: tuple, out_dir: Optional[str]) -> bool:
    from attngrad.torch.backends import triton as triton_backend

    if device == "cuda" and DOUBLE in dtypes and triton_backend._old_triton():
        print(f"float64 skipped: Triton {triton_backend._triton_version()} cannot compile it (3.9 can)", flush=True)
        dtypes = tuple(d for d in dtypes if d != DOUBLE)
    jobs = [(f.name, dtype, d, device, small) for d in widths for dtype in dtypes for f in FEATURES
            if not (dtype == DOUBLE and d > 64)]  # float64 at d = 64: its tiles are one entry at every width
    print(f"check: {len(jobs)} sets on {device} with {workers} workers", flush=True)
    start = time.perf_counter()
    if workers > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            rows = []
            for row in pool.imap_unordered(check_one, jobs):
                rows.append(row)
                _print_row(row)
    else:
        rows = []
        for job in jobs:
            rows.append(check_one(job))
            _print_row(rows[-1])
    bits = report_dropout_bits(device)
    failed = [r for r in rows if r.failure or not r.same_bits or _bad(r)]
    print(f"check: {len(rows)} sets in {time.perf_counter() - start:.0f} s, {len(failed)} failed", flush=True)
    _summary(rows)
    if out_dir:
        with open(os.path.join(out_dir, "check.jsonl"), "w") as fh:
            for r in rows:
                fh.write(json.dumps(asdict(r)) + "\n")
    return not failed and bits


def _bad(row: Row) -> bool:
    """float64 over 1e-12, NaN anywhere, or another dtype over 2x PyTorch's math path in the
    same dtype plus one unit roundoff of the products' type (the two sum in other orders).
    TF32 is judged against PyTorch's float32 products where its math path does not use TF32."""
    floor = {"float32": 2.0**-24, "tf32": 2.0**-11, "bfloat16": 2.0**-8, "float16": 2.0**-11,
             "tf32x3": 2.0**-24, "bf16x6": 2.0**-24}  # the split products judged as float32 is
    for ours, theirs in row.errors.values():
        if not math.isfinite(ours):
            return True
        if row.dtype == DOUBLE and ours > 1e-12:
            return True
        if row.dtype != DOUBLE and ours > 2 * theirs + floor[row.dtype]:
            return True
    return False


def _print_row(row: Row) -> None:
    if row.failure:
        print(f"FAIL {row.features} {row.dtype} d={row.d}:\n{row.failure}", flush=True)
        return
    worst = max(row.errors.items(), key=lambda kv: kv[1][0] / (kv[1][1] or 1e-300) if row.dtype != DOUBLE else kv[1][0])
    flag = "BAD " if _bad(row) or not row.same_bits else "ok  "
    print(f"{flag}{row.features:32s} {row.dtype:8s} d={row.d:3d} bits={row.same_bits} worst {worst[0]}: "
          f"ours {worst[1][0]:.2e} math {worst[1][1]:.2e} ({row.seconds:.0f} s)", flush=True)


def _summary(rows: list) -> None:
    print("\nworst error per dtype and result kind (ours / PyTorch math in the same dtype):")
    kinds = {"out": ("out",), "grad": ("dq", "dk", "dv", "dextra"), "jvp": ("jvp",),
             "double backward": tuple(f"gg_{n}" for n in ("q", "k", "v", "extra", "dout")),
             "hvp": tuple(f"hvp_{n}" for n in ("q", "k", "v", "extra")),
             "reverse over forward": tuple(f"rof_{n}" for n in ("q", "k", "v", "extra", "tq", "tk", "tv", "textra"))}
    for dtype in DTYPES + SPLIT:
        cells = []
        for kind, names in kinds.items():
            pairs = [r.errors[n] for r in rows if r.dtype == dtype and not r.failure for n in names if n in r.errors
                     and n not in _zero_gradients(next(f for f in FEATURES if f.name == r.features))]
            if pairs:
                worst = max(pairs, key=lambda p: p[0])
                ratio = max(p[0] / p[1] for p in pairs if p[1]) if dtype != DOUBLE else float("nan")
                cells.append(f"{kind} {worst[0]:.1e}" + (f" (max ratio {ratio:.2f})" if dtype != DOUBLE else ""))
        if cells:
            print(f"  {dtype:8s} " + "; ".join(cells))


# ---------------------------------------------------------------------------------------
# speed


@dataclass(frozen=True)
class Timed:
    name: str
    dtype: str
    B: int
    H: int
    L: int
    d: int
    causal: bool = False
    mode: str = "train"  # forward, train (fwd+bwd), bias (train with an (H, L, L) bias's gradient), jvp, double, hvp
    yardstick: str = "default"  # default or math
    products: str = "ieee"  # float32's products on our side (`config.Options.float32_products`)


def _timed_cases(quick: bool) -> list:
    L = 1024 if quick else 4096
    cases = []
    for d, H in ((128, 16), (64, 32)):
        for causal in (False, True):
            for mode in ("forward", "train"):
                cases.append(Timed(f"{mode} d={d}", "bfloat16", 4, H, L, d, causal, mode))
    cases.append(Timed("train d=128", "float16", 4, 16, L, 128, True, "train"))
    cases.append(Timed("train d=64 ieee", "float32", 4, 16, L // 2, 64, False, "train"))
    for products in SPLIT:
        cases.append(Timed(f"train d=64 {products}", "float32", 4, 16, L // 2, 64, False, "train", products=products))
    cases.append(Timed("bias grad d=64", "bfloat16", 1, 16, L // 2, 64, False, "bias"))
    for mode in ("jvp", "double", "hvp"):
        cases.append(Timed(f"{mode} d=64", "bfloat16", 1, 16, L // 2, 64, True, mode, "math"))
    return cases


def _step(case: Timed, ours: bool):
    """A function that runs one step of `case` on fresh-per-case inputs, and its inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attngrad.torch import scaled_dot_product_attention, use_backend
    from attngrad.torch.backends.triton import launch

    dtype = torch_dtype(case.dtype)
    g = torch.Generator(device="cuda").manual_seed(7)
    make = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=dtype)  # noqa: E731
    q, k, v = (make(case.B, case.H, case.L, case.d) for _ in range(3))
    dout = make(case.B, case.H, case.L, case.d)
    bias = make(case.H, case.L, case.L).requires_grad_() if case.mode == "bias" else None
    tangents = tuple(make(case.B, case.H, case.L, case.d) for _ in range(3))

    def sdpa(q, k, v):
        kwargs = dict(attn_mask=bias, is_causal=case.causal)
        if ours:
            with use_backend("triton"), launch.TUNING.override(float32_products=case.products):
                return scaled_dot_product_attention(q, k, v, **kwargs)
        if case.yardstick == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return mode_step(case.mode, sdpa, (q, k, v), dout, tangents), (q, k, v, dout, bias, tangents)


def mode_step(mode: str, sdpa, primals: tuple, dout, tangents: tuple):
    """One step of `mode` through sdpa(q, k, v): forward (no gradient), train or bias (forward
    and backward), jvp (forward + JVP), double (the double backward) or hvp (forward over
    reverse, as attngrad bench takes it)."""
    import torch

    q, k, v = primals
    leaves = [t.clone().requires_grad_() for t in primals]
    if mode == "forward":
        def step():
            with torch.no_grad():
                sdpa(q, k, v)
    elif mode in ("train", "bias"):
        def step():
            sdpa(*leaves).backward(dout)
    elif mode == "jvp":
        def step():
            torch.func.jvp(sdpa, primals, tangents)
    elif mode == "double":
        def step():
            grads = torch.autograd.grad(sdpa(*leaves), leaves, dout, create_graph=True)
            torch.autograd.backward(grads, tangents)
    else:
        vjp = lambda q, k, v, do: torch.func.vjp(sdpa, q, k, v)[1](do)  # noqa: E731

        def step():
            torch.func.jvp(vjp, (*primals, dout), tangents + (dout,))
    return step


def _flops(case: Timed) -> float:
    forward = 4 * case.B * case.H * case.L * case.L * case.d * (0.5 if case.causal else 1.0)
    return forward * {"forward": 1.0, "train": 3.5, "bias": 3.5, "jvp": 3.0}.get(case.mode, float("nan"))


def run_time(quick: bool, rounds: int, out_dir: Optional[str]) -> None:
    import torch
    import triton.testing

    print(f"\ntime: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    results = []
    header = f"{'case':22s} {'dtype':8s} {'B':>2s} {'H':>3s} {'L':>5s} {'causal':6s} {'ours ms':>9s} " \
             f"{'theirs ms':>9s} {'ratio':>6s} {'ours TF/s':>9s} {'their TF/s':>10s} {'ours MiB':>9s} {'their MiB':>9s}"
    print(header, flush=True)
    for case in _timed_cases(quick):
        try:
            times: dict = {True: [], False: []}
            memory = {}
            steps = {}
            for ours in (True, False):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                steps[ours] = _step(case, ours)
                base = torch.cuda.memory_allocated()
                steps[ours][0]()  # compile and warm
                torch.cuda.synchronize()
                memory[ours] = (torch.cuda.max_memory_allocated() - base) / 2**20
            for _ in range(rounds):
                for ours in (True, False):
                    times[ours].append(triton.testing.do_bench(steps[ours][0], warmup=25, rep=100,
                                                               return_mode="median"))
            ms = {o: sorted(t)[len(t) // 2] for o, t in times.items()}
            flops = _flops(case)
            tf = {o: flops / (ms[o] * 1e-3) / 1e12 for o in ms}
            row = dict(asdict(case), ours_ms=ms[True], theirs_ms=ms[False], ratio=ms[True] / ms[False],
                       ours_tflops=tf[True], theirs_tflops=tf[False], ours_mib=memory[True], theirs_mib=memory[False],
                       rounds=times)
            results.append(row)
            print(f"{case.name:22s} {case.dtype:8s} {case.B:2d} {case.H:3d} {case.L:5d} {str(case.causal):6s} "
                  f"{ms[True]:9.3f} {ms[False]:9.3f} {row['ratio']:6.2f} {tf[True]:9.1f} {tf[False]:10.1f} "
                  f"{memory[True]:9.0f} {memory[False]:9.0f}  vs {case.yardstick}", flush=True)
        except Exception:  # noqa: BLE001
            print(f"FAIL {case}:\n{traceback.format_exc(limit=6)}", flush=True)
        finally:
            steps = None
    if out_dir:
        with open(os.path.join(out_dir, "time.jsonl"), "w") as fh:
            for r in results:
                fh.write(json.dumps({k: v for k, v in r.items() if k != "rounds"}
                                    | {"rounds": {str(k): v for k, v in r["rounds"].items()}}) + "\n")


def warm_one(case: Timed) -> str:
    """Compile the kernels a timed case runs (Triton's cache is on disk, shared)."""
    try:
        step, _ = _step(case, True)
        step()
        return f"warm {case.name} {case.dtype} causal={case.causal}"
    except Exception:  # noqa: BLE001
        return f"warm FAILED {case}: {traceback.format_exc(limit=4)}"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("check", "time", "all", "dropout"))
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--interpret", action="store_true", help="CPU tensors in Triton's interpreter (no GPU)")
    parser.add_argument("--arch", type=int, default=90, help="with --interpret: the tiles of this GPU (90: sm_90)")
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES + SPLIT,
                        help="tf32x3 and bf16x6: float32 with split products (opt-in; not in the default)")
    parser.add_argument("--quick", action="store_true", help="time at L=1024, not 4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="a folder for check.jsonl and time.jsonl")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        from attngrad.torch.backends.triton import launch

        # the table's tiles, as on a GPU
        table = launch.blocks_for
        launch.blocks_for = lambda name, dtype, width, interpreted, tf32=False, arch=0, light=False: table(
            name, dtype, width, False, tf32, args.arch, light)
        args.workers = 1
    device = "cpu" if args.interpret else "cuda"
    ok = True
    if args.what in ("check", "all"):
        if args.what == "all" and args.workers > 1:  # the timed cases' kernels compile beside the check's
            with multiprocessing.get_context("spawn").Pool(min(args.workers, 8)) as pool:
                warming = pool.map_async(warm_one, _timed_cases(args.quick))
                ok = run_check(args.workers, device, args.interpret, tuple(args.widths), tuple(args.dtypes), args.out)
                for line in warming.get():
                    print(line, flush=True)
        else:
            ok = run_check(args.workers, device, args.interpret, tuple(args.widths), tuple(args.dtypes), args.out)
    if args.what == "dropout":
        ok = report_dropout_bits(device)
    if args.what in ("time", "all"):
        run_time(args.quick, args.rounds, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
