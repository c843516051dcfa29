"""End to end: the training job as a user installs it (the wheel alone), and the example app's README
commands as a user types them."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from launching import EXAMPLE_APP, FAST, ROOT, copy_example_app, run_job, summary


@pytest.mark.slow
def test_the_wheel_alone_runs_the_training_job(tmp_path):
    """The wheel built and installed as the README says (``pip wheel --no-deps -w dist .``, then
    ``pip install "dist/distsync-*.whl[train,optuna]"``; no checkout: no conf/, no launch/) is enough for
    distsync-train.

    The new environment gets its dependencies (torch, Hydra, ...) from this one through a ``.pth`` line,
    which adds this environment's packages but not the checkout that its editable install points to
    (``.pth`` files of a directory added that way are not run): installing torch again took half a minute.
    pip sees them there, so the install with extras resolves every requirement without an index.
    """
    wheels, venv, work = tmp_path / "wheels", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    quiet = ["-q", "--disable-pip-version-check"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", *quiet, "--no-deps", "-w", wheels, ROOT], check=True
    )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(packages) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    (wheel,) = wheels.glob("distsync-*.whl")
    install = [sys.executable, "-m", "pip", "--python", python, "install", *quiet, "--no-index"]
    subprocess.run([*install, f"{wheel}[train,optuna]"], check=True)
    where = subprocess.run(
        [python, "-c", "import distsync; print(distsync.__file__)"], cwd=work, capture_output=True
    )
    assert str(ROOT) not in where.stdout.decode() and str(venv) in where.stdout.decode()  # not the checkout
    check = run_job([python, "-m", "distsync.check", "--nproc", "2"], work)
    assert check.returncode == 0 and "12 passed, 0 failed" in check.stdout
    help_text = run_job([venv / "bin" / "distsync-train", "--help"], work).stdout
    assert "trainer: default, fast" in help_text
    (doc,) = re.findall(r"Every key is described in (\S+)\.\n", help_text)
    assert Path(doc).read_text().startswith("# Training") and str(venv) in doc  # installed with the wheel
    run_dir = work / "run"
    proc = run_job(
        [venv / "bin" / "distsync-train", f"hydra.run.dir={run_dir}", "trainer.max_steps=10", *FAST], work
    )
    assert proc.returncode == 0
    assert summary(run_dir)["steps"] == 10 and summary(run_dir)["world_size"] == 2

    # The same job under an external torchrun, as a module of the wheel: every rank in one run dir.
    torchrun = [python, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "distsync.train"]
    run_dir = work / "torchrun"
    proc = run_job([*torchrun, f"hydra.run.dir={run_dir}", "trainer.max_steps=6", *FAST], work)
    assert proc.returncode == 0
    assert summary(run_dir)["steps"] == 6 and summary(run_dir)["world_size"] == 2

    # A user's own app, copied out of the checkout, finds the wheel's hydra/launcher=torchrun plugin.
    app = copy_example_app(work / "my_app")
    plugin = ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "lr=0.05,0.2", "steps=5"]
    proc = run_job([python, "app.py", *plugin], app)
    assert proc.returncode == 0
    jobs = sorted(p.parent for p in (app / "multirun").glob("*/*/*/rank1.json"))
    assert len(jobs) == 2 and all((job / "rank0.json").exists() for job in jobs)


def _readme_commands(readme: Path) -> list[list[str]]:
    """The commands of a README's bash block that run the app (``python``, ``torchrun``): continued lines
    joined, comments left out, the install line too."""
    block = re.search(r"```bash\n(.*?)```", readme.read_text(), re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] in (["python"], ["torchrun"]):
            commands.append(words)
    return commands


def _files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


@pytest.mark.slow
def test_the_example_apps_readme_commands_leave_nothing_the_tests_copy(tmp_path):
    """Whoever follows examples/hydra_app/README.md inside the checkout leaves Hydra's run and sweep folders
    in the app's folder: the tests copy the app without them, so their runs find their own jobs only."""
    pristine = copy_example_app(tmp_path / "pristine")
    used = copy_example_app(tmp_path / "used")
    commands = _readme_commands(EXAMPLE_APP / "README.md")
    assert len(commands) >= 5 and any(words[0] == "torchrun" for words in commands), commands
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    for words in commands:
        program = [sys.executable] if words[0] == "python" else torchrun
        # 4 of the Optuna command's 20 trials leave the same files (test_optuna_sweeper runs a search whole)
        words = ["hydra.sweeper.n_trials=4" if w.startswith("hydra.sweeper.n_trials=") else w for w in words]
        proc = run_job([*program, *words[1:], "steps=2"], used, timeout=240)
        assert proc.returncode == 0, shlex.join(words)
    assert {"outputs", "multirun"} <= {path.name for path in used.iterdir()}
    assert _files(copy_example_app(tmp_path / "copy", source=used)) == _files(pristine)
