"""attngrad's Triton backend beside its peers on one GPU, side by side and interleaved: time,
TFLOP/s and peak memory per case (issue 60, item 7). A program for a lent GPU.

    pip download jvp-flash-attention==0.14.0 --no-deps -d .wheels     # here, once (.wheels is ignored)
    pip install --no-deps .wheels/*.whl                                # on the GPU machine (carry .wheels)
    python benchmarks/gpu_peers.py --out docs/gpu-runs/DATE-h200 --docs docs/gpu.md
    python benchmarks/gpu_peers.py --interpret                         # a dry run on the CPU, tiny

The peers, where each runs the case:
    torch        PyTorch's default SDPA (flash or cuDNN in half precision; memory-efficient
                 for a float bias with its gradient)
    flex         FlexAttention, compiled: a causal block mask, a bias captured by its score_mod
    jvp-flash    jvp-flash-attention's `JVPAttn.fwd_dual` (forward + JVP; dual tensors)
    math         PyTorch's math path (forward + JVP and the second-order passes)

Each case's steps run in turn, round after round (`triton.testing.do_bench`, median), on the
same inputs; memory is the peak allocated beyond the inputs, over the first step. A peer that
fails or is missing gets its reason printed, not a time. The FLOP counts follow docs/gpu.md
(F = 4 B H L^2 d, halved where causal; forward 1 F, forward and backward 3.5 F, forward + JVP
3 F). With `--docs` the Markdown table replaces the section of docs/gpu.md between its
markers `<!-- gpu_peers -->` and `<!-- /gpu_peers -->`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Optional

from gpu_check import Timed, _flops, mode_step

BEGIN, END = "<!-- gpu_peers -->", "<!-- /gpu_peers -->"


def _case(mode: str, dtype: str, B: int, H: int, L: int, d: int, causal: bool = False) -> Timed:
    name = f"{mode} {dtype} d={d}{' causal' if causal else ''} B={B} L={L}"
    return Timed(name, dtype, B, H, L, d, causal, mode)


def cases(small: bool) -> list[Timed]:
    """The bars' cases (H * d = 2048): B = 4, L = 4096 for the plain passes, B = 1, L = 2048 for
    the bias and second-order ones (the math path's memory), float32 at L = 2048."""
    if small:
        return [_case(m, "float32", 1, 2, 64, 16, c) for m in ("forward", "train", "jvp") for c in (False, True)] \
            + [_case(m, "float32", 1, 2, 64, 16) for m in ("bias", "double", "hvp")]
    out = [_case(m, "bfloat16", 4, 2048 // d, 4096, d, c) for m in ("forward", "train", "jvp") for d in (64, 128)
           for c in (False, True)]
    out += [_case("train", "float32", 4, 32, 2048, 64), _case("bias", "bfloat16", 1, 16, 2048, 128)]
    out += [_case(m, "bfloat16", 1, 16, 2048, 64, True) for m in ("double", "hvp")]
    return out


def _inputs(case: Timed, device: str):
    import torch

    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(7)
    make = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    q, k, v, dout = (make(case.B, case.H, case.L, case.d) for _ in range(4))
    tangents = tuple(make(case.B, case.H, case.L, case.d) for _ in range(3))
    bias = make(case.H, case.L, case.L) if case.mode == "bias" else None
    return q, k, v, dout, tangents, bias


def _attention(peer: str, case: Timed, bias) -> Callable:
    """sdpa(q, k, v) as `peer` computes it, or raises why it cannot."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if peer == "attngrad":
        from attngrad.torch import scaled_dot_product_attention, use_backend

        def ours(q, k, v):
            with use_backend("triton"):
                return scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=case.causal)
        return ours
    if peer in ("torch", "math"):
        def theirs(q, k, v):
            if peer == "math":
                with sdpa_kernel(SDPBackend.MATH):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=case.causal)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=case.causal)
        return theirs
    if peer == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        block_mask = None
        if case.causal:
            block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, case.L, case.L,
                                           device=device)
        score_mod = None
        if bias is not None:
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[h, q_idx, kv_idx]
        return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    raise ValueError(peer)


def _step(peer: str, case: Timed, device: str) -> Callable[[], None]:
    """One step of `case` by `peer` on the case's inputs (fresh per peer, the same numbers)."""
    q, k, v, dout, tangents, bias = _inputs(case, device)
    if bias is not None:
        bias.requires_grad_()
    if peer == "jvp-flash":
        if case.mode != "jvp":
            raise NotImplementedError("forward + JVP only")
        import torch.autograd.forward_ad as fwAD
        from jvp_flash_attention.jvp_attention import JVPAttn

        def jvp_flash():
            with fwAD.dual_level():
                duals = [fwAD.make_dual(p, t) for p, t in zip((q, k, v), tangents)]
                fwAD.unpack_dual(JVPAttn.fwd_dual(*duals, causal=case.causal))
        return jvp_flash
    return mode_step(case.mode, _attention(peer, case, bias), (q, k, v), dout, tangents)


def peers_of(case: Timed) -> list[str]:
    if case.mode in ("forward", "train", "bias"):
        return ["attngrad", "torch", "flex"]
    if case.mode == "jvp":
        return ["attngrad", "jvp-flash", "math"]
    return ["attngrad", "math"]


def _time(step: Callable[[], None], device: str) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median")
    import time

    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def run_case(case: Timed, device: str, rounds: int) -> dict:
    import torch

    steps, memory, failed = {}, {}, {}
    for peer in peers_of(case):
        try:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            step = _step(peer, case, device)
            if device == "cuda":
                base = torch.cuda.memory_allocated()
            step()  # compile and warm
            if device == "cuda":
                torch.cuda.synchronize()
                memory[peer] = (torch.cuda.max_memory_allocated() - base) / 2**20
            steps[peer] = step
        except Exception as error:  # noqa: BLE001
            failed[peer] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]
    times: dict = {peer: [] for peer in steps}
    for _ in range(rounds):
        for peer, step in steps.items():
            times[peer].append(_time(step, device))
    ms = {peer: sorted(t)[len(t) // 2] for peer, t in times.items()}
    return dict(case=asdict(case), label=case.name, ms=ms, rounds=times, mib=memory, failed=failed,
                tflops={peer: _flops(case) / (t * 1e-3) / 1e12 for peer, t in ms.items()})


def _print(result: dict) -> None:
    print(result["label"], flush=True)
    ours = result["ms"].get("attngrad")
    for peer, t in result["ms"].items():
        ratio = f"{ours / t:6.2f}x" if ours else "     -"
        mib = result["mib"].get(peer)
        print(f"    {peer:10s} {t:9.3f} ms  {result['tflops'][peer]:7.1f} TF/s  "
              f"{'' if mib is None else f'{mib:8.0f} MiB'}  attngrad / it {ratio}", flush=True)
    for peer, why in result["failed"].items():
        print(f"    {peer:10s} did not run: {why}", flush=True)


def markdown(results: list, where: str) -> str:
    lines = [BEGIN, "", f"`benchmarks/gpu_peers.py`, {where}: medians of interleaved rounds; the ratio is attngrad's",
             "time over the peer's (below 1: attngrad faster).", "",
             "| case | peer | ms | TFLOP/s | peak MiB | attngrad / peer |", "|---|---|---|---|---|---|"]
    for r in results:
        ours = r["ms"].get("attngrad")
        for peer, t in r["ms"].items():
            mib = r["mib"].get(peer)
            tf = r["tflops"][peer]
            lines.append(f"| {r['label']} | {peer} | {t:.3f} | {'' if tf != tf else f'{tf:.0f}'} | "
                         f"{'' if mib is None else f'{mib:.0f}'} | {'' if not ours else f'{ours / t:.2f}x'} |")
        for peer, why in r["failed"].items():
            lines.append(f"| {r['label']} | {peer} | did not run: {why.replace('|', '/')} | | | |")
    return "\n".join(lines + ["", END])


def write_section(path: str, section: str) -> None:
    with open(path) as fh:
        text = fh.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to replace")
    head, rest = text.split(BEGIN, 1)
    with open(path, "w") as fh:
        fh.write(head + section + rest.split(END, 1)[1])


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="CPU tensors in Triton's interpreter (no GPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="+", default=None, help="modes to run (forward, train, bias, jvp, ...)")
    parser.add_argument("--out", default=None, help="a folder for peers.jsonl and peers.md")
    parser.add_argument("--docs", default=None, help="docs/gpu.md: replace its gpu_peers section")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        args.rounds = 1
    import torch
    import triton

    device = "cpu" if args.interpret else "cuda"
    where = ("the CPU, Triton's interpreter (a dry run: no figure here is a GPU's)" if args.interpret else
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    print(where, flush=True)
    results = []
    for case in cases(args.interpret):
        if args.only and case.mode not in args.only:
            continue
        try:
            result = run_case(case, device, args.rounds)
        except Exception:  # noqa: BLE001
            print(f"FAIL {case.name}:\n{traceback.format_exc(limit=4)}", flush=True)
            continue
        results.append(result)
        _print(result)
    section = markdown(results, where)
    if args.out:
        with open(os.path.join(args.out, "peers.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in results)
        with open(os.path.join(args.out, "peers.md"), "w") as fh:
            fh.write(section + "\n")
    if args.docs:
        write_section(args.docs, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
