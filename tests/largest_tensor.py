"""The largest tensor any operator returns inside a block, watched at PyTorch's dispatcher:
the memory tests hold it below L x L.

    with LargestTensor() as seen:
        model(...).sum().backward()
    assert seen.numel < length * length
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.numel = 0  # the most elements of any tensor an operator has returned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out
