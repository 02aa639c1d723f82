"""Smoke test of trainnorm installed from its wheel (.ci/run runs it in a fresh venv).

Run from outside the repository, so that only the installed package can be imported.
Checks: the package and its data come from the venv, the declared dependencies,
the CPU reference path (forward, backward, module) against torch, the kernels in
Triton's interpreter when TRITON_INTERPRET=1, and the console script.
"""
import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig

import torch
import torch.nn.functional as F

import trainnorm

site = sysconfig.get_paths()["purelib"]
assert trainnorm.__file__.startswith(site), f"trainnorm imported from {trainnorm.__file__}, not {site}"
dist = md.distribution("trainnorm")
requires = dist.requires or []
assert any(r.startswith("triton") and 'sys_platform == "linux"' in r for r in requires), requires
assert not any(r.split(";")[0].strip().startswith("numpy") and "extra ==" not in r for r in requires), requires
assert dist.metadata["License-Expression"] == "Apache-2.0", dist.metadata["License-Expression"]

interpreter = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
torch.manual_seed(0)
x = torch.randn(3, 5, 256).to(torch.bfloat16).requires_grad_()
w = (torch.rand(256) + 0.5).requires_grad_()
y = trainnorm.rms_norm(x, w, 1e-6)
y.float().square().sum().backward()
x2, w2 = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
y2 = F.rms_norm(x2, (256,), w2, 1e-6)
y2.square().sum().backward()
torch.testing.assert_close(y.float(), y2, rtol=1e-2, atol=1e-2)
torch.testing.assert_close(x.grad.float(), x2.grad, rtol=2e-2, atol=2e-2)
torch.testing.assert_close(w.grad, w2.grad, rtol=1e-2, atol=1e-2)   # y is rounded to bf16
m = trainnorm.RMSNorm(256)
assert isinstance(m, torch.nn.RMSNorm) and m.eps is None
torch.testing.assert_close(m(x2.detach()), torch.nn.RMSNorm(256)(x2.detach()), rtol=1e-5, atol=1e-5)
from trainnorm.configs import table   # package data: the measured config table the kernels read

assert table.path("sm_90").startswith(site) and "sm_90" in table.archs() and table.load("sm_90")
print(f"wheel smoke: {'kernels in the interpreter' if interpreter else 'CPU reference path'} OK "
      f"(trainnorm {trainnorm.__version__} from {os.path.dirname(trainnorm.__file__)})")

if not interpreter:
    script = os.path.join(os.path.dirname(sys.executable), "trainnorm")
    out = subprocess.run([script, "demo", "--tiny"], check=True, capture_output=True, text=True).stdout
    assert "demo: OK" in out, out
    print("wheel smoke: `trainnorm demo --tiny` OK")
