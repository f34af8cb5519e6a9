"""The CPU compatibility module changes nothing on import and redirects only inside its context."""
from __future__ import annotations

import subprocess
import sys

import torch

from learner import cpu_compat


def test_import_patches_nothing():
    code = ("import torch; before = torch.cuda.current_device; import learner, learner.cpu_compat as c; "
            "assert torch.cuda.current_device is before and not c.is_applied(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_cuda_to_cpu_mode_redirects_factories_and_type_names():
    with cpu_compat.CudaToCpuMode():
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu"
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.to("cuda").device.type == "cpu"
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_device_redirect_is_the_mode_only_without_gpu():
    ctx = cpu_compat.device_redirect()
    assert isinstance(ctx, cpu_compat.CudaToCpuMode) != torch.cuda.is_available()
