"""The fused backward's first run on a GPU, kept short so that a hang or a wrong order shows
before anything longer runs: bfloat16, B = 4, L = 4096, H * d = 2048, causal and not; the
fused backward (`config.Options.fused_backward`) against the split one, its gradients' largest
difference, whether a rerun gives the same bits, and each one's time (median of
`triton.testing.do_bench`). Exit status 1 if the fused one differs from the split one by
more than bfloat16's rounding or changes its bits on a rerun.

    python benchmarks/gpu_fused_smoke.py
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch
    import triton
    import triton.testing
    from gpu_light_call import triton_backward

    from attngrad.torch.backends.triton import launch

    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    ok = True
    for d in (64, 128):
        for causal in (False, True):
            backward = triton_backward(d, causal)
            grads, ms = {}, {}
            for fused in (True, False):
                with launch.TUNING.override(fused_backward=fused):
                    grads[fused] = backward()
                    again = backward()
                    ms[fused] = triton.testing.do_bench(backward, warmup=10, rep=50, return_mode="median")
                same = all(torch.equal(a, b) for a, b in zip(grads[fused], again))
                ok &= same
                print(f"d={d} causal={causal} fused={fused} same bits on a rerun: {same}  {ms[fused]:.3f} ms",
                      flush=True)
            diffs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                     for a, b in zip(grads[True], grads[False])]
            ok &= max(diffs) < 2e-2
            print(f"d={d} causal={causal} fused / split: {ms[True] / ms[False]:.3f}x; dq, dk, dv relative "
                  f"difference {', '.join(f'{x:.1e}' for x in diffs)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
