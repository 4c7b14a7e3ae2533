"""Zeroed int32 scratch for kernels that leave it zero again (split-K tile counters, grid barriers).

Launches that run one after another may share a buffer: each finds it zero and leaves it zero. So
eager launches share one buffer per (device, stream, size), and the launches of one CUDA graph
capture share one of their own per (capture, size): graphs replayed concurrently with each other or
with eager work never share. Shared buffers are zeroed once and never freed or replaced, because a
captured graph may point at them (a capture's buffer lives in the graph's memory pool; its zeroing
is part of the graph).
A private zeroed allocation per launch (its memset part of the same work) serves:
- `private=True`: launches from the registered torch ops, i.e. from compiled graphs. torch.compile's
  CUDA-graph trees reject tensors that outlive a call in their pool, and their warm-up runs are not
  captures, so nothing here could tell them apart;
- captures whose id cuda-python cannot report.
"""
from __future__ import annotations

import torch

_shared: dict[tuple[int, int, int, int], torch.Tensor] = {}


def zeroed_int32(device_index: int, numel: int, private: bool = False) -> torch.Tensor:
    """`numel` int32 zeros on the device, for one launch on the current stream that returns them to zero."""
    if not private:
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        capture = _capture_id(stream) if torch.cuda.is_current_stream_capturing() else -1
        if capture is not None:
            key = (device_index, stream, numel, capture)
            buf = _shared.get(key)
            if buf is None:
                buf = _shared[key] = torch.zeros(numel, dtype=torch.int32, device=torch.device("cuda", device_index))
            return buf
    return torch.zeros(numel, dtype=torch.int32, device=torch.device("cuda", device_index))


_unread: dict[int, torch.Tensor] = {}


def unread_float32(device_index: int) -> torch.Tensor:
    """A few fp32 elements per device that stand in for a workspace a launch never touches (the split-K
    partials of an unsplit launch): the kernel's signature wants a tensor there."""
    buf = _unread.get(device_index)
    if buf is None:
        buf = _unread[device_index] = torch.empty(4, dtype=torch.float32, device=torch.device("cuda", device_index))
    return buf


def shared_buffers() -> dict[tuple[int, int, int, int], torch.Tensor]:
    """Every shared buffer by (device, stream, numel, capture): what tests check is back to zero."""
    return dict(_shared)


def _capture_id(stream: int) -> int | None:
    """The (process-unique) id of the capture sequence `stream` takes part in, or None."""
    try:
        from cuda.bindings import runtime

        err, status, capture, *_ = runtime.cudaStreamGetCaptureInfo(stream)
        active = status == runtime.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive
        return int(capture) if err == runtime.cudaError_t.cudaSuccess and active else None
    except Exception:  # noqa: BLE001 - no cuda-python: a private buffer per launch
        return None
