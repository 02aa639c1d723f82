"""Installs where users are: trainnorm without Triton (it ships Linux wheels only) and
without numpy, and the dependencies the package declares.

Triton's absence is simulated in a subprocess whose import system cannot find
`triton` (nor `numpy`): the path finder answers "not found" for them, as it does
on a machine where they are not installed. (.ci/run also builds the wheel and
smoke-tests it in a fresh venv.)
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HIDE = textwrap.dedent('''
    import sys
    from importlib.machinery import PathFinder

    HIDDEN = ("triton", "numpy")

    class WithoutHidden:
        """The path finder, for which the hidden packages are not installed."""
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] in HIDDEN:
                return None
            return PathFinder.find_spec(name, path, target)
        invalidate_caches = PathFinder.invalidate_caches

    sys.meta_path[:] = [WithoutHidden if f is PathFinder else f for f in sys.meta_path]
    for name in [m for m in sys.modules if m.split(".")[0] in HIDDEN]:
        del sys.modules[name]
''')


def _run_hidden(code: str, interpreter: str = "0") -> str:
    env = dict(os.environ, TRITON_INTERPRET=interpreter, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, "-c", HIDE + textwrap.dedent(code)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_hiding_works():
    # the simulation itself: the hidden packages cannot be imported
    _run_hidden('''
        import importlib.util
        for name in HIDDEN:
            assert importlib.util.find_spec(name) is None, name
            try:
                __import__(name)
            except ImportError:
                pass
            else:
                raise AssertionError(f"{name} imported")
    ''')


def test_cpu_path_without_triton_or_numpy():
    out = _run_hidden('''
        import sys
        import torch
        import trainnorm
        from trainnorm import reference
        from trainnorm.integrations import patch_transformers_classes, patch_transformers
        assert not [m for m in sys.modules if m.split(".")[0] in HIDDEN], "a hidden package was imported"

        torch.manual_seed(0)
        x = torch.randn(6, 96).to(torch.bfloat16).requires_grad_()
        r = torch.randn(6, 96).to(torch.bfloat16).requires_grad_()
        w = (torch.rand(96) + 0.5).requires_grad_()
        y, h = trainnorm.rms_norm(x, w, 1e-6, residual=r)
        dy = torch.randn(6, 96).to(torch.bfloat16)
        (y.float() * dy.float()).sum().backward()
        y64, rstd64, h64 = reference.forward_fp64(x.detach(), w.detach(), 1e-6, r.detach())
        torch.testing.assert_close(y.double(), y64, rtol=1e-2, atol=1e-2)
        assert torch.equal(h, h64)
        _, rstd, _ = trainnorm.rms_norm_forward(x.detach(), w.detach(), 1e-6, residual=r.detach())
        dx64, dw64 = reference.backward_fp64(dy, h.detach(), w.detach(), rstd, None)
        torch.testing.assert_close(x.grad.double(), dx64, rtol=1e-2, atol=1e-2)
        assert torch.equal(x.grad, r.grad)
        torch.testing.assert_close(w.grad.double(), dw64, rtol=1e-4, atol=1e-4)
        m = trainnorm.RMSNorm(96)
        assert isinstance(m, torch.nn.RMSNorm)
        m(torch.randn(2, 96)).sum().backward()
        g = trainnorm.rms_norm_gated(torch.randn(2, 96), torch.randn(2, 96), torch.ones(96))
        assert not [m for m in sys.modules if m.split(".")[0] in HIDDEN], "a hidden package was imported"
        print("cpu path ok")
    ''')
    assert "cpu path ok" in out


def test_cli_without_triton_or_numpy():
    out = _run_hidden('''
        import sys
        from trainnorm.cli import main
        assert main(["demo", "--tiny"]) == 0
        import tempfile
        assert main(["verify", "--shapes", "[T,4", "--tokens", "2", "--seeds", "1", "--out", tempfile.mkdtemp()]) == 0
        assert not [m for m in sys.modules if m.split(".")[0] in HIDDEN], "a hidden package was imported"
    ''')
    assert "demo: OK" in out and "verify: PASS" in out


def test_kernels_without_triton_say_so():
    # TRITON_INTERPRET=1 (or a CUDA tensor) needs the kernels: an ImportError that names Triton,
    # raised at the launch, after the arguments were checked
    out = _run_hidden('''
        import torch
        import trainnorm
        try:
            trainnorm.rms_norm(torch.ones(2, 8), torch.ones(8), eps=-1.0)
        except ValueError as e:
            assert "eps must be finite" in str(e)
        try:
            trainnorm.rms_norm(torch.ones(2, 8), torch.ones(8))
        except ImportError as e:
            print("ImportError:", e)
        else:
            raise AssertionError("the kernels ran without Triton")
    ''', interpreter="1")
    assert "ImportError: trainnorm's Triton kernel" in out and "No module named 'triton'" in out
    assert "CPU tensors without TRITON_INTERPRET run the float64 reference path" in out


def _pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _names(reqs):
    return {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip(): r for r in reqs}


def test_declared_dependencies():
    project = _pyproject()["project"]
    deps = _names(project["dependencies"])
    assert set(deps) == {"torch", "triton"}, "the package imports torch, and triton where it installs"
    assert "sys_platform == 'linux'" in deps["triton"].replace('"', "'"), deps["triton"]
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    assert "numpy" in extras["test"], "Triton's interpreter (the CPU tests) and the soak import numpy"
    assert {"tqdm", "numpy", "matplotlib"} <= set(extras["bench"])
    assert project["license"] == "Apache-2.0", "an SPDX expression, not the deprecated table"
    requires = _pyproject()["build-system"]["requires"]
    assert any(r.startswith("setuptools>=") and int(r.split(">=")[1].split(".")[0]) >= 77 for r in requires), \
        "setuptools reads license expressions from 77 on"


def test_package_imports_only_what_it_declares():
    """No module of the package imports numpy or tqdm at its top level (they are extras), and
    only kernels/ imports triton there (dispatch.py imports kernels/ where Triton exists)."""
    import ast
    pkg = ROOT / "src" / "trainnorm"
    offenders = []
    for path in pkg.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                rel = path.relative_to(pkg).as_posix()
                if top in ("numpy", "tqdm") or (top == "triton" and not rel.startswith("kernels/")):
                    offenders.append(f"{rel}: {name}")
    assert not offenders, offenders
