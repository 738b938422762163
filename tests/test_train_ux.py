"""Small UX promises of the trainer: epochs are 1-based in the progress bar and the epoch line, the
digits command names the extra to install when scikit-learn is missing, and that extra exists."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib

from tests.dist_utils import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def test_progress_bar_and_epoch_line_count_epochs_alike(digits_data: dict, tmp_path) -> None:
    cmd = [sys.executable, "-m", "trainer", "--recipe", "digits", "--data", digits_data["train"], "--cache",
           digits_data["cache"], "--device", "cpu", "--threads", "1", "--epochs", "2",
           "--steps-per-epoch", "2", "--batch-size", "32", "--width", "4", "--resolution", "16",
           "--val-every", "0", "--workers", "0", "--progress", "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bar = proc.stderr  # tqdm writes the bar to stderr
    assert "epoch 1:" in bar and "epoch 2:" in bar and "epoch 0:" not in bar
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch ")]
    assert [ln.split()[1] for ln in lines] == ["1/2", "2/2"]


def test_digits_without_scikit_learn_names_the_extra(tmp_path) -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.modules["sklearn"] = None  # as if scikit-learn were not installed
        from trainer.cli import main
        sys.exit(main(["digits", {str(tmp_path / "d")!r}]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "datacache-train: error: the digits dataset needs scikit-learn, which the 'train' extra installs: "
        "pip install 'datacache[train]' (from a checkout: pip install -e '.[train]')"]


def test_train_extra_brings_scikit_learn_and_test_keeps_it() -> None:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(d.startswith("scikit-learn") for d in extras["train"])
    assert any(d.startswith("scikit-learn") for d in extras["test"])
