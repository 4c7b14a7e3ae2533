"""Whether an sm_90 CUDA device is visible (the `gpu` marker skips without one)."""


def _has_sm90() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


HAS_SM90 = _has_sm90()
