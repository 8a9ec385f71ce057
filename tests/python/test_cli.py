"""The `ulysses` command end to end: output, errors and exit codes, under `ulysses launch` and
under plain torchrun with its default rendezvous."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

ULYSSES = shutil.which("ulysses", path=os.path.dirname(sys.executable)) or "ulysses"


def run(*args, timeout=240, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env, **kw)


def test_plan_json_gqa():
    r = run(ULYSSES, "plan", "--q-heads", "6", "--kv-heads", "3", "--sp", "2", "--seq-len", "10", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["q_heads"] == [4, 2] and plan["kv_heads"] == [2, 1]
    assert plan["q_ranges"] == [[0, 4], [4, 6]] and plan["kv_map"] == [[0, 0, 1, 1], [0, 0]]
    assert plan["seq_lens"] == [5, 5]


def test_plan_json_mqa_replicates_kv():
    r = run(ULYSSES, "plan", "--q-heads", "2", "--kv-heads", "1", "--sp", "2", "--json")
    plan = json.loads(r.stdout)
    assert plan["kv_ranges"] == [[0, 1], [0, 1]] and plan["kv_map"] == [[0], [0]]


def test_plan_too_few_heads_fails_with_message():
    r = run(ULYSSES, "plan", "--q-heads", "1", "--sp", "2")
    assert r.returncode == 1
    assert "query heads (1) must be >= sequence-parallel size (2)" in r.stderr


def test_demo_4_ranks():
    r = run(ULYSSES, "demo", "--nproc", "4", "--seq-len", "130")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0] PASS" in r.stdout


def test_launch_stops_the_others_on_failure():
    r = run(ULYSSES, "launch", "-n", "3", "--", "sh", "-c", 'if [ $RANK = 1 ]; then exit 3; fi; sleep 60',
            timeout=30)
    assert r.returncode == 3


@pytest.mark.parametrize("args", [
    ["--nproc", "2", "--seq-len", "63", "--pairs", "4"],
    ["--nproc", "4", "--sp", "2", "--dp", "2", "--seq-len", "33", "--pairs", "4"],
])
def test_train_check_matches_single_rank(args):
    r = run(ULYSSES, "train", *args, "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0] PASS" in r.stdout and "FAIL" not in r.stdout


def test_train_check_under_torchrun_default_rendezvous():
    """Plain torchrun: its agent serves the store on MASTER_PORT and every rank joins it as a
    client (TORCHELASTIC_USE_AGENT_STORE), through torch.distributed's env:// rendezvous."""
    with socket.socket() as s:  # a free loopback port for the agent's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(port), "-m", "ulysses", "train", "--seq-len", "63", "--pairs", "4",
            "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "FAIL" not in r.stdout


def test_train_resume_equals_uninterrupted(tmp_path):
    common = ["--nproc", "2", "--seq-len", "48", "--pairs", "4", "--batch", "2", "--eval-every", "0"]

    def losses(out):
        return [line.split("loss ")[1].split()[0] for line in out.splitlines() if " loss " in line]

    full = run(ULYSSES, "train", *common, "--steps", "6")
    assert full.returncode == 0, full.stderr
    first = run(ULYSSES, "train", *common, "--steps", "3", "--save", str(tmp_path / "ckpt"))
    assert first.returncode == 0, first.stderr
    resumed = run(ULYSSES, "train", *common, "--steps", "6", "--resume", str(tmp_path / "ckpt"))
    assert resumed.returncode == 0, resumed.stderr
    assert len(losses(full.stdout)) == 6
    assert losses(resumed.stdout) == losses(full.stdout)[3:]
