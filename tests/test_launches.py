"""trainnorm.dev.launches: every launch of the bench's rows, recorded on the CPU."""
from pathlib import Path

import pytest

from trainnorm import configs
from trainnorm.bench import shapes
from trainnorm.dev import launches


def _row(rid):
    return next(r for r in shapes.all_rows() if r.id == rid)


@pytest.mark.parametrize("rid", ["H512 T256", "[T,24,256] T1024", "H4096 T1024 gate", "H6144 T4096 res w32"])
def test_row_launches_name_every_kernel_of_both_modes(rid):
    lines = launches.row_launches(_row(rid))
    by = {}
    for line in lines:
        head, launch = line.split(": ", 1)
        by.setdefault(head, []).append(launch)
    assert set(by) == {"fwd trainnorm", "bwd trainnorm", "fwd trainnorm-fast", "bwd trainnorm-fast"}, lines
    assert by["fwd trainnorm"] == by["fwd trainnorm-fast"], "both modes run the same forward"
    assert all(" grid [" in launch and "num_warps=" in launch for launch in sum(by.values(), []))
    assert by["fwd trainnorm"][0].startswith("fwd_"), by["fwd trainnorm"]
    if "[T,24,256]" in rid:       # the strided view is read in place: its strides are in the line
        assert "[12288, 512, 1]" in by["fwd trainnorm"][0]


def test_a_config_change_shows_in_the_lines_of_its_op_only():
    row = _row("H512 T4096")
    before = launches.row_launches(row)
    with configs.override(backward=lambda key, cur: cur.replace(max_chunks=66, rows_max_chunks=())):
        after = launches.row_launches(row)
    fwd = lambda ls: [x for x in ls if x.startswith("fwd ")]
    bwd = lambda ls: [x for x in ls if x.startswith("bwd ")]
    assert fwd(before) == fwd(after)
    assert bwd(before) != bwd(after)


def test_kernels_digest_follows_the_kernels_source(tmp_path, monkeypatch):
    # the digest covers every source file of trainnorm.kernels: a changed body changes it
    import shutil

    from trainnorm import kernels
    before = launches.kernels_digest()
    assert before == launches.kernels_digest() and len(before) == 40
    copy = tmp_path / "kernels"
    shutil.copytree(Path(kernels.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(kernels, "__file__", str(copy / "__init__.py"))
    assert launches.kernels_digest() == before, "the same files, elsewhere"
    forward = copy / "forward.py"
    forward.write_text(forward.read_text() + "\n# a change\n")
    assert launches.kernels_digest() != before


def test_main_lists_the_selected_rows(capsys):
    assert launches.main(["--set", "default,block", "--shapes", "^H512 T256$", "--shapes", "block T4096"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"# kernels' source sha1 {launches.kernels_digest()}"
    out = out[1:]
    assert all(line.startswith("H512 T256 | ") for line in out if "block" not in line)
    assert any("decoder block" in line for line in out)
    assert launches.main(["--set", "nonsense"]) == 2


def test_with_launch_pdl_the_backwards_launches_are_programmatic_dependent_on_sm_90(monkeypatch):
    """The lines are the GPU's (sm_90, the default table's): with dispatch.LAUNCH_PDL the
    backward's kernel and its dw combine launch with PDL, the forward plainly unless
    FORWARD_PDL says so too."""
    from trainnorm import dispatch
    monkeypatch.setattr(dispatch, "LAUNCH_PDL", True)
    lines = launches.row_launches(_row("H512 T4096"))
    kernels = {line.split(": ", 1)[1].split(" ", 1)[0] for line in lines}
    assert "dw_combine_kernel" in kernels, lines
    bwd = [line for line in lines if line.startswith("bwd ")]
    fwd = [line for line in lines if line.startswith("fwd ")]
    assert bwd and fwd
    if dispatch.HAS_PDL:
        assert all("PDL=True" in line and "launch_pdl=True" in line for line in bwd), bwd
        assert not any("PDL=True" in line for line in fwd), fwd
        monkeypatch.setattr(dispatch, "FORWARD_PDL", True)
        assert all("PDL=True" in line for line in launches.row_launches(_row("H512 T4096")))
    else:
        assert not any("PDL=True" in line for line in lines), lines


def test_launch_pdl_false_launches_plainly(monkeypatch):
    from trainnorm import dispatch
    monkeypatch.setattr(dispatch, "LAUNCH_PDL", False)
    monkeypatch.setattr(dispatch, "FORWARD_PDL", True)
    lines = launches.row_launches(_row("H512 T4096"))
    assert lines and not any("PDL=True" in line or "launch_pdl" in line for line in lines), lines


@pytest.mark.parametrize("value, pdl, hold", [(None, True, True), ("0", False, False), ("1", True, True)])
def test_environment_switches(value, pdl, hold):
    # TRAINNORM_PDL (programmatic dependent launch, on unless "0") and TRAINNORM_RESIDUAL_HOLD
    # (the residual's held walks, on unless "0") are read when trainnorm is imported
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINNORM_PDL", "TRAINNORM_RESIDUAL_HOLD")}
    if value is not None:
        env.update(TRAINNORM_PDL=value, TRAINNORM_RESIDUAL_HOLD=value)
    out = subprocess.run([sys.executable, "-c", "from trainnorm import dispatch, plan; "
                          "print(dispatch.LAUNCH_PDL, plan.RESIDUAL_HOLD)"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(pdl), str(hold)]
