"""The layers of rosekernels' `kernels` repository (rosekernels.hub). `kernels` binds a layer's forward
to the module it replaces, so `self` is that module (its `weight`, `variance_epsilon`), and refuses a
layer with state or members of its own: the checks live in module functions."""
from __future__ import annotations

import functools

import torch
from torch import nn

import rosekernels
from rosekernels import checks
from rosekernels.kernels import rmsnorm_plan

rosekernels.rmsnorm  # noqa: B018  (load the op now: a forward traced by torch.compile then finds a plain attribute)


@functools.lru_cache(maxsize=None)
def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rosekernels.rmsnorm computes what the stock forward does for (x, weight): an sm_90 tensor
    of a dtype it takes, a width it takes, and the weight in x's dtype (stock returns weight * the
    normalised x, so an fp32 weight would make an fp32 output)."""
    if not (x.is_cuda and x.dtype in rmsnorm_plan.DTYPES and weight.dtype == x.dtype and x.dim() >= 1):
        return False
    width = x.shape[-1]
    return (0 < width <= rmsnorm_plan.MAX_HIDDEN and width % checks.vector_elems(checks.DTYPE_NAME[x.dtype]) == 0
            and tuple(weight.shape) == (width,) and _sm90(x.device))


class RMSNorm(nn.Module):
    """forward(hidden_states) -> rosekernels.rmsnorm over the last dimension (fp32 math, one rounding to
    the input dtype), or the module's own forward where the kernel does not take the call."""

    can_torch_compile = True  # rosekernels.rmsnorm is a torch.library custom op
    has_backward = False  # a forward kernel: kernelize keeps the stock forward in training mode

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _takes(hidden_states, self.weight):
            return rosekernels.rmsnorm(hidden_states, self.weight, eps=self.variance_epsilon)
        return type(self).forward(self, hidden_states)
