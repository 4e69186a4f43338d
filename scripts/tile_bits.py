"""Every pass of the compiled tiles on a fixed grid of cases, saved, or compared bit for bit
with a saved run: how `portable_tiles.sh` holds a build without AVX-512 (ATTNGRAD_MARCH)
to the numbers of the native one.

    python scripts/tile_bits.py save FILE      # results of this process's tiles
    python scripts/tile_bits.py compare FILE   # this process's against FILE's; exit 1 if any bit differs
    python scripts/tile_bits.py save FILE plain/float64 causal   # only the cases (name, or name/dtype) named

The grid: float64, float32 and bfloat16; causal and not, GQA, Lq != Lk, d not a multiple
of 16 (every row sweep has a tail); a boolean mask with a learned bias, dropout, a soft cap,
a sliding window, packed documents, sinks, one query row; the forward, the backward, the
JVP, the double backward and the HVP.
"""

from __future__ import annotations

import sys

import torch

from attngrad.torch import attention, ran
from attngrad.torch.backends.cpu_tiles import native

# Results a build without AVX-512 rounds apart from the native one, and by how much at most
# (relative to the result's largest entry): the soft cap's 16-lane tanh, whose FMAs GCC
# contracts differently once the vectors are split in two for AVX2 (tanh_small and tanh_any
# alone give the same bits on both builds), by a float32 ulp of the largest entry at most
# (measured up to 8.7e-8 of it).
KNOWN_ROUNDING = {"softcap/float32/": 2.0 ** -23}
DTYPES = (torch.float64, torch.float32, torch.bfloat16)


def _cases() -> list[tuple[str, dict]]:
    return [
        ("plain", {}),
        ("causal", dict(is_causal=True)),
        ("mask+bias", dict(mask=True, bias=True)),
        ("dropout", dict(dropout_p=0.1)),
        ("softcap", dict(is_causal=True, softcap=20.0)),
        ("window", dict(is_causal=True, window=(37, None))),
        ("documents", dict(cu_seqlens=torch.tensor([0, 61, 150, 203]))),
        ("sinks", dict(is_causal=True, sinks=True)),
        # lengths and an even width on which bfloat16's products run on oneDNN's brgemm (where
        # PyTorch packs bfloat16: bf16_products.cpp, use_brgemm), Lq odd
        ("long", dict(is_causal=True, long=True)),
        # one query row (a decode step: row_products.h's one-row tiles), a width whose last
        # 61 mod 16 and 61 mod 8 entries GCC's vectoriser splits by the target's vector width
        ("decode", dict(decode=True)),
    ]


def _results(seed: int, options: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if options.get("long"):
        len_q, len_k, dim = 261, 300, 64
    elif options.get("decode"):
        len_q, len_k, dim = 1, 300, 61
    else:
        len_q, len_k, dim = 203 if "cu_seqlens" in options else 150, 203, 59
    shapes = dict(q=(2, 4, len_q, dim), k=(2, 2, len_k, dim), v=(2, 2, len_k, dim))
    inputs = {n: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for n, shape in shapes.items()}
    dout = torch.randn(2, 4, len_q, dim, generator=g, dtype=torch.float64).to(dtype)
    tangents = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype) for t in inputs.values()]
    kwargs = {k: v for k, v in options.items() if k not in ("mask", "bias", "sinks", "long", "decode")}
    if options.get("mask"):
        kwargs["attn_mask"] = torch.rand(2, 1, len_q, len_k, generator=g) > 0.3
    leaves = [t.clone().requires_grad_() for t in inputs.values()]
    if options.get("bias"):
        leaves.append(torch.randn(4, len_q, len_k, generator=g, dtype=torch.float64).to(dtype).requires_grad_())
    if options.get("sinks"):
        leaves.append(torch.randn(4, generator=g, dtype=torch.float64).to(dtype).requires_grad_())

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        extra = dict(kwargs)
        rest = list(rest)
        if options.get("bias"):
            extra["attn_bias"] = rest.pop(0)
        if options.get("sinks"):
            extra["sinks"] = rest.pop(0)
        torch.manual_seed(7)  # the dropout's draws
        return attention(q, k, v, enable_gqa=True, **extra)

    out = call(*leaves)
    grads = torch.autograd.grad(out, leaves, dout, create_graph=dtype != torch.bfloat16)
    results = {"out": out, **{f"grad{i}": gr for i, gr in enumerate(grads)}}
    if dtype != torch.bfloat16 and not options.get("dropout_p"):
        second = torch.autograd.grad(sum((gr.float() ** 2).sum() for gr in grads), leaves)
        results.update({f"second{i}": s for i, s in enumerate(second)})
        fixed = [t.detach() for t in leaves[3:]]
        primals = tuple(t.detach() for t in leaves[:3])
        results["jvp"] = torch.func.jvp(lambda q, k, v: call(q, k, v, *fixed), primals, tuple(tangents))[1]
        hvp = torch.func.jvp(lambda q, k, v: torch.func.vjp(lambda *x: call(*x, *fixed), q, k, v)[1](dout),
                             primals, tuple(tangents))[1]
        results.update({f"hvp{i}": h for i, h in enumerate(hvp)})
    return {key: value.detach().clone() for key, value in results.items()}


def run(only: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The grid's results, or those of the cases `only` names ("plain", "plain/float64")."""
    assert native.available(), native.build_info.reason
    ran.clear()
    results = {}
    for seed, (name, options) in enumerate(_cases()):  # a case's seed is its place in the whole grid
        for dtype in DTYPES:
            case = f"{name}/{str(dtype)[6:]}"
            if only and not any(pick in (name, case) for pick in only):
                continue
            for key, value in _results(seed, options, dtype).items():
                results[f"{case}/{key}"] = value
    assert ran and all(implementation == "tiles" for _, implementation in ran), dict(ran)
    return results


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("save", "compare"):
        print(__doc__)
        return 2
    command, path, only = argv[0], argv[1], argv[2:]
    names = {pick for name, _ in _cases() for pick in (name, *(f"{name}/{str(dtype)[6:]}" for dtype in DTYPES))}
    if set(only) - names:
        print(f"no such case: {sorted(set(only) - names)}")
        return 2
    results = run(only)
    if command == "save":
        torch.save(results, path)
        print(f"saved {len(results)} results of {native.build_info.path}")
        return 0
    saved = torch.load(path)
    # a selection of cases is compared with the same results of FILE, which may hold the whole grid
    keys = [key for key in results if key in saved] if only else list(saved)
    missing = sorted(set(results) - set(saved)) if only else sorted(set(saved) - set(results))
    if missing:
        print(f"{len(missing)} results not in both {path} and this run: {missing[:3]}")
        return 2
    differ = [key for key in keys if not torch.equal(saved[key], results[key])]
    failed = []
    for key in differ:
        a, b = saved[key].double(), results[key].double()
        relative = float((a - b).abs().max() / a.abs().max())
        allowed = next((bound for prefix, bound in KNOWN_ROUNDING.items() if key.startswith(prefix)), 0.0)
        verdict = "known rounding" if relative <= allowed else "FAILED"
        if relative > allowed:
            failed.append(key)
        print(f"{key}: bits differ by {relative:.2g} of the largest entry ({verdict})")
    print(f"{len(keys) - len(differ)} of {len(keys)} results bit for bit the same as {path}'s; "
          f"{len(failed)} differ beyond KNOWN_ROUNDING")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
