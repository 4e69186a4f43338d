"""attngrad: the gradient of Transformer attention, in closed form, proved.

`attngrad.reference` computes every gradient with NumPy alone; `attngrad.check` proves
them against finite differences and, when PyTorch is installed, against its autograd.
"""

__version__ = "0.1.0"
