"""Each kernel's share of a training step on a GPU: one forward and backward of a light
bfloat16 call (B = 4, L = 4096, H * d = 2048, d = 64 and 128, causal and not) through
attngrad's Triton backend and through PyTorch's default SDPA, under `torch.profiler`, after
warm-up steps; prints each kernel's CUDA time per step, largest first.

    python benchmarks/gpu_profile.py [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F
    from gpu_light_call import inputs
    from torch.profiler import ProfilerActivity, profile

    from attngrad.torch import scaled_dot_product_attention, use_backend

    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for d in (64, 128):
        for causal in (False, True):
            leaves, dout = inputs(d)
            for name in ("attngrad", "pytorch"):
                def step():
                    if name == "attngrad":
                        with use_backend("triton"):
                            out = scaled_dot_product_attention(*leaves, is_causal=causal)
                    else:
                        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                    out.backward(dout)

                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.steps):
                        step()
                    torch.cuda.synchronize()
                per_kernel: dict = defaultdict(float)
                for event in prof.events():
                    if event.device_type == torch.autograd.DeviceType.CUDA:
                        device_time = getattr(event, "device_time", None) or event.cuda_time
                        per_kernel[event.name[:70]] += device_time / args.steps / 1e3
                total = sum(per_kernel.values())
                print(f"\n{name} d={d} causal={causal}: {total:.3f} ms of kernels per step", flush=True)
                for kernel, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]:
                    print(f"  {ms:7.3f} ms  {kernel}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
