"""CPU stand-ins for the device parts of an op's calls (the CUDA check, SM count, tuned store, compile and
launch), so that CPU tests see which calls of a planned signature, whose fast path skips the full checks,
still launch."""
from types import SimpleNamespace

from rosekernels import checks, launch, modes, tuned


def stub_launches(monkeypatch, kernel_module, op_module) -> list:
    """Plans of `op_module` made anew, with `kernel_module`'s compiled function a stand-in: returns the list
    it appends each launch's arguments to."""
    launches = []
    monkeypatch.setattr(checks, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(modes, "sm_count", lambda *args: 132)
    monkeypatch.setattr(modes, "max_active_clusters", lambda *args: 66)
    monkeypatch.setattr(tuned, "tuned_config", lambda module, shape, config, sms=None: config)
    monkeypatch.setattr(launch, "on_device", lambda device, fn, *args: fn(*args))
    kernel = SimpleNamespace(fn=lambda *args: launches.append(args))
    monkeypatch.setattr(kernel_module, "compile", lambda config: kernel)
    monkeypatch.setattr(op_module, "_plans", launch.PlanCache())
    return launches
