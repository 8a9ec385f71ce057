"""The `ulysses` command end to end: output, errors and exit codes, under `ulysses launch` and
under plain torchrun with its default rendezvous."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

ULYSSES = shutil.which("ulysses", path=os.path.dirname(sys.executable)) or "ulysses"


def run(*args, timeout=240, env_extra=None, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
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


def test_plan_beyond_the_head_count_recommends_a_ring_split():
    r = run(ULYSSES, "plan", "--q-heads", "1", "--sp", "2")
    assert r.returncode == 0, r.stderr
    assert "recommended: 1x2" in r.stdout


def test_plan_invalid_heads_fails_with_message():
    r = run(ULYSSES, "plan", "--q-heads", "3", "--kv-heads", "2", "--sp", "2")
    assert r.returncode == 1
    assert "query heads (3) must be a multiple of kv heads (2)" in r.stderr


def test_demo_4_ranks():
    r = run(ULYSSES, "demo", "--nproc", "4", "--seq-len", "130")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0] PASS" in r.stdout


def test_launch_stops_the_others_on_failure():
    r = run(ULYSSES, "launch", "-n", "3", "--", "sh", "-c", 'if [ $RANK = 1 ]; then exit 3; fi; sleep 60',
            timeout=30)
    assert r.returncode == 3


@pytest.mark.parametrize("args", [
    ["--nproc", "2", "--seq-len", "63", "--pairs", "4", "--timeout", "30"],
    ["--nproc", "4", "--sp", "2", "--dp", "2", "--seq-len", "33", "--pairs", "4"],
    ["--nproc", "4", "--ring", "2", "--seq-len", "37", "--pairs", "4"],  # Ulysses 2 x ring 2
    # The long-sequence options against the whole model on one rank.
    ["--nproc", "2", "--seq-len", "63", "--pairs", "4", "--tiled", "--checkpoint", "offload"],
    ["--nproc", "4", "--ring", "2", "--seq-len", "37", "--pairs", "4", "--checkpoint", "recompute"],
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
    common = ["--nproc", "2", "--seq-len", "48", "--pairs", "4", "--batch", "2", "--eval-every", "0",
              "--log-every", "1", "--lr-decay-steps", "6"]

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
    # Every progress line splits its collective time: the wait for the last rank is part of it.
    shares = re.findall(r" comm ([0-9.]+)% \(waiting ([0-9.]+)%\) ", full.stdout)
    assert len(shares) == 6, full.stdout
    assert all(0 <= float(w) <= float(c) for c, w in shares), shares


COMMON = ["--nproc", "2", "--seq-len", "48", "--pairs", "4", "--batch", "2", "--eval-every", "0"]


def test_save_path_is_never_run_by_a_shell(tmp_path):
    evil = tmp_path / "ckpt'; touch INJECTED; echo '"
    r = run(ULYSSES, "train", *COMMON, "--steps", "1", "--save", str(evil), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (evil / "state.txt").exists()
    assert not (tmp_path / "INJECTED").exists()


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert run(ULYSSES, "train", *COMMON, "--steps", "2", "--save", ckpt).returncode == 0
    crashed = run(ULYSSES, "train", *COMMON, "--steps", "3", "--resume", ckpt, "--save", ckpt,
                  env_extra={"ULYSSES_TEST_CRASH_BEFORE_COMMIT": "1"})
    assert crashed.returncode != 0
    resumed = run(ULYSSES, "train", *COMMON, "--steps", "3", "--resume", ckpt)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout


def _fnv1a(data: bytes, basis: int = 14695981039346656037) -> int:
    """FNV-1a, 64 bits (independently of src/plan/fnv1a.h): a checkpoint's file hash."""
    h = basis
    for b in data:
        h = ((h ^ b) * 1099511628211) % 2**64
    return h


def test_checkpoints_hash_with_fnv1a_and_format_1_still_loads(tmp_path):
    """Format 2 hashes with FNV-1a's own offset basis; format 1 (earlier releases) used one a digit
    short. A format-1 checkpoint still resumes, checked by its own basis, and is still refused
    when a file does not match it."""
    ckpt = tmp_path / "ckpt"
    assert run(ULYSSES, "train", *COMMON, "--steps", "2", "--save", str(ckpt)).returncode == 0
    state = (ckpt / "state.txt").read_text().splitlines()
    assert state[0] == "ulysses-checkpoint 2"
    files = [line.split() for line in state if line.startswith("file ")]
    assert all(int(h, 16) == _fnv1a((ckpt / name).read_bytes()) for _, name, _, h in files), files

    def as_format_1(basis: int) -> None:
        lines = ["ulysses-checkpoint 1"] + [
            line if not line.startswith("file ") else
            " ".join(line.split()[:3] + [f"{_fnv1a((ckpt / line.split()[1]).read_bytes(), basis):x}"])
            for line in state[1:]]
        (ckpt / "state.txt").write_text("\n".join(lines) + "\n")

    as_format_1(1469598103934665603)
    resumed = run(ULYSSES, "train", *COMMON, "--steps", "3", "--resume", str(ckpt))
    assert resumed.returncode == 0 and "at step 2" in resumed.stdout, resumed.stdout + resumed.stderr
    as_format_1(14695981039346656037)  # format 2's hashes under format 1's name: refused
    refused = run(ULYSSES, "train", *COMMON, "--steps", "3", "--resume", str(ckpt))
    assert refused.returncode == 1 and "is truncated or corrupted" in refused.stderr, refused.stderr


def test_corrupted_checkpoint_is_the_same_clear_error_on_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run(ULYSSES, "train", *COMMON, "--steps", "2", "--save", str(ckpt)).returncode == 0
    model = ckpt / "model-2.pt"
    data = model.read_bytes()
    model.write_bytes(data[: len(data) // 2])  # truncated
    r = run(ULYSSES, "train", *COMMON, "--steps", "4", "--resume", str(ckpt))
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if "is truncated or corrupted" in line]
    # Both ranks raised the same error; it is shown once, as rank 0's.
    assert len(lines) == 1 and lines[0].startswith("[rank 0] "), r.stderr
    assert "[launch] rank 1 printed the same as rank 0" in r.stderr
    assert str(model) in lines[0]


def test_resume_with_nothing_left_to_train_fails(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert run(ULYSSES, "train", *COMMON, "--steps", "2", "--save", ckpt).returncode == 0
    r = run(ULYSSES, "train", *COMMON, "--steps", "2", "--resume", ckpt)
    assert r.returncode == 2
    assert "leaves nothing to train" in r.stderr


def test_data_file_too_small_for_a_held_out_split(tmp_path):
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 300)
    r = run(ULYSSES, "train", "--nproc", "1", "--seq-len", "48", "--data", str(small), "--steps", "1")
    assert r.returncode == 2
    assert "need at least 10 x (seq-len + 1) = 490" in r.stderr


def imported_modules(*args) -> set[str]:
    """The modules a run of the `ulysses` command imports (Python's -X importtime report)."""
    r = run(ULYSSES, *args, env_extra={"PYTHONPROFILEIMPORTTIME": "1"})
    lines = [line for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert lines, r.stderr
    return {line.rsplit("|", 1)[1].strip() for line in lines[1:]}


def test_version_and_help_do_not_import_torch():
    # They print from the C++ command table, loaded without the package (about 0.4 s, not 2-3 s).
    for args in (["--version"], ["--help"], ["train", "--help"], ["bench", "a2a", "-h"], []):
        assert "torch" not in imported_modules(*args), args
    # A command that needs a process group in this process does import it (one rank; plan: the
    # next test). `launch` needs none: its command (which owns its --help) runs in its own process.
    assert "torch" in imported_modules("demo", "--nproc", "1", "--seq-len", "8", "--head-dim", "2")
    assert "torch" not in imported_modules("launch", "-n", "1", "--", sys.executable, "-c", "pass", "--help")


def test_plan_loads_neither_torch_nor_libtorch():
    # The pure planner answers from ulysses._plan (c10 and the plan floor): no torch module, no
    # libtorch mapped, and the same answer as the package's planner.
    code = ("import json, sys, _ulysses_command as c; sys.argv = ['ulysses'] + sys.argv[1:]; "
            "status = c.main(); maps = open('/proc/self/maps').read(); "
            "print(json.dumps([status, 'torch' in sys.modules, 'libtorch_cpu' in maps]), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code, "plan", "--q-heads", "6", "--kv-heads", "3", "--sp", "2",
                        "--json"], capture_output=True, text=True, timeout=240)
    assert json.loads(r.stderr.strip().splitlines()[-1]) == [0, False, False], r.stderr
    import ulysses

    assert json.loads(r.stdout)["q_ranges"] == [list(q) for q in ulysses.plan(6, 3, 2)["q_ranges"]]
    assert "torch" not in imported_modules("plan", "--q-heads", "2", "--sp", "2")
    bad = run(ULYSSES, "plan", "--q-heads", "0", "--sp", "2")  # Errors read as every command's.
    assert bad.returncode == 2 and bad.stderr == ("ulysses plan: option --q-heads must be in [1, 65536]; got 0 "
                                                  "(see 'ulysses plan --help')\n"), bad.stderr


def test_import_ulysses_does_not_load_dynamo():
    # torch._dynamo costs each rank about 3 s of start-up; only AutoSP (first use) needs it.
    # (ulysses.hf imports transformers, which loads it by itself.)
    code = "import sys, ulysses; print('torch._dynamo' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr[-2000:])


def test_version_and_help_per_command():
    r = run(ULYSSES, "--version")
    assert r.returncode == 0 and r.stdout.startswith("ulysses 0.3.0 (torch 2.13")
    # One version: pyproject.toml's, in the package metadata, the module and the C++ build.
    import re

    import ulysses
    pyproject = open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")).read()
    declared = re.search(r'\nversion = "([0-9.]+)"', pyproject).group(1)
    assert ulysses.__version__ == declared and r.stdout.startswith(f"ulysses {declared} ")
    for command in (["train"], ["plan"], ["demo"], ["launch"], ["bench", "a2a"], ["bench", "layer"],
                    ["bench", "attention"], ["bench", "gemm"]):
        r = run(ULYSSES, *command, "--help")
        assert r.returncode == 0 and r.stdout.startswith("usage: ulysses " + " ".join(command)), r
    full = run(ULYSSES, "--help").stdout
    for option in ("--ffn-dim", "--weight-decay", "--eval-sequences", "--addr", "bench a2a",
                   "bench layer", "--log-every", "--timeout"):
        assert option in full


@pytest.mark.parametrize("args,message", [
    (["train", "--nproc", "0"], "option --nproc must be in [1, 4096]; got 0"),
    (["train", "--nproc", "-2"], "option --nproc must be in [1, 4096]; got -2"),
    (["bench", "a2a", "--nproc", "0"], "option --nproc must be in [1, 4096]; got 0"),
    (["plan", "--q-heads", "4", "--sp", "2", "--seq-len", "-5"], "option --seq-len must be >= 1; got -5"),
    (["bench", "attention", "--repeats", "0"], "option --repeats must be in [1, 100000]; got 0"),
    (["bench", "attention", "--head-dim", "0"], "option --head-dim must be >= 1; got 0"),
    (["bench", "layer", "--seq-lens", "0"], "option --seq-lens must be >= 1; got 0"),
    (["train", "--help-me"], "unknown option --help-me"),
    (["plan", "--q-heads", "4", "--sp", "2", "--bogus"], "unknown option --bogus"),
    (["plan", "--q-heads", "4", "--sp", "2", "--jsn", "--seq-len", "100"], "unknown option --jsn"),
    (["plan", "--q-heads", "4", "--sp"], "option --sp needs a value"),
    (["plan", "--q-heads", "4", "--sp", "2", "--json=1"], "option --json takes no value"),
    (["train", "--steps", "ten"], "option --steps must be an integer; got 'ten'"),
    (["launch", "--", "true"], "-n N (the number of ranks) is required"),
    (["bench"], "say which bench: attention, a2a, layer or gemm"),
    (["bench", "nope"], "unknown bench 'nope'; choose attention, a2a, layer or gemm"),
    (["train", "--timeout", "0"], "option --timeout must be in [1, 86400]; got 0"),
    (["bench", "layer", "--timeout", "-1"], "option --timeout must be in [1, 86400]; got -1"),
    (["bench", "a2a", "--message-kib", "0"], "option --message-kib must be in [1, 1099511627776]; got 0"),
    (["train", "--steps", "0"], "option --steps must be >= 1; got 0"),
    (["train", "--checkpoint", "disk"], "option --checkpoint must be none, recompute or offload; got 'disk'"),
    (["bench", "a2a", "--transport", "nccl"], "option --transport must be auto, messages or batched; got 'nccl'"),
    (["plan", "--q-heads", "4", "--sp", "2", "--seq-len", "0"], "option --seq-len must be >= 1; got 0"),
    (["bench", "attention", "--math-limit-gb", "-1"], "option --math-limit-gb must be >= 0; got -1"),
    (["train", "--lr", "11"], "option --lr must be in [0, 10]; got 11"),
    (["launch", "-n", "2", "--addr", "not-an-address!", "--", "true"],
     "option --addr must be an IP address or a host name that resolves here; got 'not-an-address!'"),
    # Found by scripts/fuzz.sh: a plan listing 5e16 heads per rank; a newline in an option.
    (["plan", "--q-heads", "333333333333333331", "--sp", "6"],
     "option --q-heads must be in [1, 65536]; got 333333333333333331"),
    (["plan", "--q-heads", "4\n", "--sp", "2"], "option --q-heads must be an integer; got '4\\x0a'"),
    (["plan", "--q-heads", "4", "--sp", "2", "-\x01\n", "4"], "unknown option -\\x01\\x0a"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message):
    r = run(ULYSSES, *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "--help'" in lines[0], r.stderr
    assert "bench: bench:" not in r.stderr


def test_mesh_error_names_what_the_user_gave():
    r = run(ULYSSES, "train", "--nproc", "4", "--dp", "3", "--steps", "1")
    assert r.returncode == 2
    assert "--dp 3 must divide the number of ranks (4)" in r.stderr
    assert "--sp" not in r.stderr.split("must divide")[0]
    assert r.stderr.count("must divide") == 1


@pytest.mark.parametrize("args,message", [
    (["--nproc", "4", "--dp", "3"], "--dp 3 must divide the number of ranks (4)"),
    (["--nproc", "4", "--ring", "3"], "the ring size (3) must divide the sequence-parallel size (4)"),
    (["--nproc", "2", "--q-heads", "6", "--kv-heads", "4"], "--q-heads (6) must be a multiple of --kv-heads (4)"),
    (["--nproc", "2", "--dim", "100", "--q-heads", "8"], "--dim 100 must split into 8 heads"),
    (["--nproc", "2", "--seq-len", "32"], "retrieval task: seq-len (32)"),
    (["--nproc", "2", "--data", "/nonexistent/file.txt"], "cannot read --data file"),
])
def test_static_train_errors_exit_2_before_any_rank_starts(args, message):
    # No rank started: a rank prints its output behind "[rank r] ", and none may appear.
    r = run(ULYSSES, "train", *args, "--steps", "1")
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "[rank" not in r.stdout + r.stderr, r.stderr


@pytest.mark.parametrize("args,message", [
    (["train", "--nproc", "0"], "option --nproc must be in [1, 4096]; got 0"),
    (["bench", "layer", "--nproc", "2", "--ring", "3"], "--ring 3 must divide the 2 ranks (--nproc)"),
    (["bench", "layer", "--nproc", "4", "--q-heads", "2", "--kv-heads", "1"], "query heads (2) must be >= "),
    (["demo", "--nproc", "4", "--q-heads", "2", "--kv-heads", "2"], "query heads (2) must be >= "),
    (["train", "--nproc", "2", "--save", "{file}"], "is a file, not a directory"),
    (["train", "--nproc", "2", "--save", "{file}/checkpoint"], "cannot be made: Not a directory"),
    (["train", "--nproc", "2", "--resume", "{empty}"], "(state.txt missing)"),
    (["train", "--nproc", "2", "--resume", "{empty}/none"], "is not a checkpoint directory (it does not exist)"),
])
def test_refusals_come_before_any_rank_starts_and_without_torch(tmp_path, args, message):
    """Everything a command can check without ranks is refused by the launcher itself, which
    never imports torch (2-3 s of the 5-7 s a refusal once took) nor starts a rank (30-42 s on a
    busy machine, when ranks refused it)."""
    (tmp_path / "file").write_text("")
    (tmp_path / "empty").mkdir()
    args = [a.format(file=tmp_path / "file", empty=tmp_path / "empty") for a in args]
    r = run(ULYSSES, *args, env_extra={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=120)  # (a hang detector)
    modules = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    said = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert r.returncode == 2 and len(said) == 1 and message in said[0], r.stderr[-3000:]
    assert "[rank" not in r.stdout + r.stderr and "torch" not in modules


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """The launcher's rank processes, by RANK (read from /proc)."""
    with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    ranks = {}
    for pid in children:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        ranks[int(env[b"RANK"])] = pid
    return ranks


def test_frozen_rank_ends_the_job_within_its_timeout_and_is_named():
    import signal
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    job = subprocess.Popen([ULYSSES, "train", "--nproc", "2", "--steps", "100000", "--timeout", "4",
                            "--log-every", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env)
    try:
        # Wait for training to run (a step logged), then freeze rank 1 as a debugger would.
        assert job.stdout.readline().startswith("[rank 0]")
        while "step" not in job.stdout.readline():
            pass
        os.kill(_rank_pids(job.pid)[1], signal.SIGSTOP)
        frozen_at = time.monotonic()
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - frozen_at
    finally:
        job.kill()
    assert job.returncode != 0
    # Rank 0 says where it waits long before its timeout ends the job, then fails on it; the
    # launcher stops the frozen rank (SIGTERM + SIGCONT) within its grace period.
    assert "has waited 1.0 s of its 4.0 s timeout in" in err and "for ranks 1" in err, err
    assert "timeout 4000 ms" in err, err
    assert took < 5 * (4 + 3), took  # A hang detector only: 5x the timeout and grace period.


def test_a_rank_late_by_less_than_its_timeout_is_no_error():
    """--timeout is seconds on every path: the last rank starting step 3 2 s late under --timeout 5
    (a checkpoint, an evaluation elsewhere; a test hook of the tests' build) only delays the job,
    which finishes every step, rank 0 having said that it waits."""
    r = run(ULYSSES, "train", "--nproc", "2", "--seq-len", "64", "--pairs", "4", "--steps", "6", "--eval-every", "0",
            "--timeout", "5", env_extra={"ULYSSES_TEST_LAST_RANK_LATE_MS": "2000"})
    assert r.returncode == 0 and "step 6/6" in r.stdout, r.stderr[-3000:]
    assert "of its 5.0 s timeout" in r.stderr, r.stderr[-3000:]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # A zombie has ended.
    except FileNotFoundError:
        return False


def test_ranks_die_with_their_launcher_even_on_sigkill():
    import signal
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    job = subprocess.Popen([ULYSSES, "train", "--nproc", "2", "--steps", "100000", "--log-every", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        while "step" not in job.stdout.readline():
            pass
        ranks = list(_rank_pids(job.pid).values())
        assert len(ranks) == 2 and all(_alive(p) for p in ranks)
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in ranks), [p for p in ranks if _alive(p)]
    finally:
        job.kill()


def test_plan_json_is_valid_json_for_every_small_layout(capfd):
    # In process (the `ulysses` command's own module), so 8 x 8 x 8 layouts take seconds.
    from ulysses import _cli

    def no_groups(*_):
        raise AssertionError("plan needs no process group")

    valid = 0
    for hq in range(1, 9):
        for hkv in range(1, 9):
            for sp in range(1, 9):
                argv = ["plan", "--q-heads", str(hq), "--kv-heads", str(hkv), "--sp", str(sp),
                        "--seq-len", "64", "--json"]
                code = _cli.run_cli(argv, [sys.executable, "-m", "ulysses"], no_groups, no_groups)
                out, err = capfd.readouterr()
                if hq % hkv:  # Not a GQA layout: refused, and nothing on stdout.
                    assert code == 1 and out == "" and "multiple of kv heads" in err, (argv, err)
                    continue
                assert code == 0, (argv, err)
                plan = json.loads(out)
                assert (plan["total_q_heads"], plan["total_kv_heads"], plan["sp"]) == (hq, hkv, sp)
                assert plan["meshes"] and plan["recommended"]
                if hq >= sp:
                    assert sum(plan["q_heads"]) == hq and sum(plan["seq_lens"]) == 64
                valid += 1
    assert valid == 8 * sum(1 for hq in range(1, 9) for hkv in range(1, 9) if hq % hkv == 0)


PLACEHOLDERS = {"P": "1", "D": "1", "R": "1", "N": "1", "S": "64", "K": "4096", "M": "4096", "STEPS": "10",
                "G": "1", "FILE": "x", "DIR": "x", "SECONDS": "10", "M,N,K,...": "8,8,8"}


def _help_options(synopsis: str) -> list[list[str]]:
    """Each option of a usage synopsis as the arguments that pass it: ["--seq-len", "256"] for
    "[--seq-len 256]", ["--check"] for "[--check]" (defaults, or a valid stand-in)."""
    import re
    out = []
    # Options start a word ("-parallel" in the command's description is none).
    for name, value in re.findall(r"(?:^|(?<=[\s\[]))(--?[a-z][a-z0-9-]*)(?: ([^\]\s]+))?\]?", synopsis):
        if name in ("--help", "--"):
            continue
        if not value or value.startswith("-") or value == "<command>":
            out.append([name])
        else:
            value = PLACEHOLDERS.get(value, value.split("|")[0])
            out.append([name, value])
    return out


@pytest.mark.parametrize("command", [["train"], ["plan"], ["demo"], ["launch"], ["bench", "attention"],
                                     ["bench", "a2a"], ["bench", "layer"], ["bench", "gemm"]])
def test_every_option_in_help_is_accepted(command):
    # Every option the help shows, with its default, followed by one unknown option: the parser
    # must name only the unknown one (it reports unknown options before doing any work).
    usage = run(ULYSSES, *command, "--help").stdout
    options = _help_options(usage.split(" ".join(command), 1)[1])
    assert len(options) >= 2, usage
    argv = [a for option in options for a in option]
    tail = ["--", "true"] if command == ["launch"] else []
    r = run(ULYSSES, *command, *argv, "--zzz", "1", *tail)
    assert r.returncode == 2 and "unknown option --zzz" in r.stderr, (argv, r.stderr)


def test_a_full_dev_shm_falls_back_to_messages_exactly():
    """Shared memory (the default) with a /dev/shm too small for an outbox (a 512 KiB tmpfs in a
    private mount namespace): each rank warns once and sends those blocks as messages; the run
    logs the same losses as one without shared memory."""
    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=512k tmpfs /dev/shm"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs in a private mount namespace here (needs root and unshare)")

    def train(*extra):
        script = (f"mount -t tmpfs -o size=512k tmpfs /dev/shm && exec {ULYSSES} train --nproc 2 "
                  f"--steps 3 --pipeline-min-kib 0 --timeout 60 {' '.join(extra)}")
        r = run("unshare", "-m", "sh", "-c", script, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        return r

    def losses(out):
        return [line.split("loss ")[1].split()[0] for line in out.splitlines() if " loss " in line]

    full, off = train(), train("--no-shared-memory")
    warning = re.compile(r"/dev/shm cannot hold a \d+-byte shared-memory outbox \(No space left on device\)")
    assert len(warning.findall(full.stdout + full.stderr)) == 2, full.stdout + full.stderr  # once per rank
    assert not warning.search(off.stdout + off.stderr)
    assert len(losses(full.stdout)) >= 2 and losses(full.stdout) == losses(off.stdout)


def test_every_numeric_option_has_its_range_in_the_table(capfd):
    """Walks every command's option table: each option whose default is a number is numeric
    with a range, and a value just below the range (0 or a negative where those mean nothing)
    exits 2 before any work, naming the option and its range."""
    from ulysses import _cli

    def no_groups(*_):
        raise AssertionError("a usage error needs no process group")

    checked = 0
    for command, options in _cli.option_ranges().items():
        for name, kind, lo, hi, default in options:
            try:
                float(default.split(",")[0])
                numeric_default = True
            except ValueError:
                numeric_default = False
            assert kind or not numeric_default, f"{command} {name} (default {default}) has no range"
            if not kind:
                continue
            assert lo > -1e18, f"{command} {name}: no lower bound"
            outside = [str(int(lo) - 1) if kind != "real" else repr(lo - 1.0)]
            if hi < 1e18:  # And just above a finite upper bound.
                outside.append(str(int(hi) + 1) if kind != "real" else repr(hi + 1.0))
            for value in outside:
                code = _cli.run_cli([*command.split(), name, value], [sys.executable, "-m", "ulysses"], no_groups,
                                    no_groups)
                _, err = capfd.readouterr()
                assert code == 2 and f"option {name} must be" in err and ("in [" in err or ">= " in err), (
                    command, name, value, err)
            checked += 1
    assert checked >= 50, checked
