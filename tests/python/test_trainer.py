"""ulysses.trainer under transformers' Trainer and TRL's SFTTrainer: real torchrun launches of
examples/hf_trainer.py (a tiny Llama from a config) at SP 2 and DP 2 x SP 2, with DDP or FSDP2,
against the plain
single-process Trainer on the same data and global batch: every logged loss, the evaluation loss
and the final parameters. Needs accelerate (the Trainer's) and, for the TRL case, trl: both come
from PyPI into the venv (scripts/setup.sh); without them these tests skip and say so."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install accelerate)")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
STEPS = 8
TOLERANCE = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(out: Path, nproc: int, *args: str, example: Path = EXAMPLE, steps: int = STEPS) -> dict:
    """Runs the example (torchrun for nproc > 1) and returns its report: losses, eval loss and the
    final parameters."""
    report = out / "report"
    command = [sys.executable, str(example)]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(example)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([*command, "--steps", str(steps), "--out", str(out), "--report", str(report), *args],
                          env=env, capture_output=True, text=True, timeout=900)  # a hang detector only
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(report.with_suffix(".json").read_text())
    result["params"] = torch.load(report.with_suffix(".pt"))
    result["out"] = out
    return result


# What a Trainer logs that is a clock's, not the run's; and its FLOPs estimate, which counts
# padding, and one process pads the whole global batch where DP ranks pad their own parts.
_NOT_COMPARED = ("_runtime", "_per_second", "step_time", "total_flos")


def _assert_same_logs(got: list[dict], want: list[dict]) -> None:
    """Every metric the trainer logged in training (losses, token counts, rewards and their
    deviations, accuracies, entropies, norms) as the run without SP logged it: the same entries,
    the same keys, the same values to TOLERANCE. (Evaluations: eval_loss, compared by the caller,
    where both runs evaluated.)"""
    got, want = ([e for e in logs if not any(k.startswith("eval_") for k in e)] for logs in (got, want))
    assert [sorted(e) for e in got] == [sorted(e) for e in want], (got, want)
    for g, w in zip(got, want):
        for key, value in w.items():
            if any(t in key for t in _NOT_COMPARED) or not isinstance(value, (int, float)):
                continue
            # (Floor 0.1: a difference of two metrics, DPO's reward margin, carries its parts'
            # rounding; a count twice over or a deviation of duplicates misses by far more.)
            assert abs(g[key] - value) <= TOLERANCE * max(abs(value), 0.1), \
                f"step {w.get('step')} {key}: {g[key]} vs {value}"


def _assert_same_run(got: dict, want: dict, steps: list[int] | None = None) -> None:
    if steps is None:
        _assert_same_logs(got["logs"], want["logs"])
    steps = steps or sorted(int(k) for k in want["losses"])
    for step in steps:
        g, w = got["losses"][str(step)], want["losses"][str(step)]
        # (A floor for losses that are zero up to rounding: RLOO's first step, 1e-9.)
        assert abs(g - w) <= TOLERANCE * max(abs(w), 1e-3), f"step {step}: loss {g} vs {w}"
    if want.get("eval_loss") is not None:
        assert abs(got["eval_loss"] - want["eval_loss"]) <= TOLERANCE * abs(want["eval_loss"])
    diff = sum((got["params"][k] - w).norm() ** 2 for k, w in want["params"].items()) ** 0.5
    norm = sum(w.norm() ** 2 for w in want["params"].values()) ** 0.5
    assert diff <= TOLERANCE * norm, f"final parameters differ: {diff / norm:.3g} relative"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per configuration, shared by the tests below."""
    cache: dict = {}

    def run(name: str, nproc: int, *args: str) -> dict:
        if name not in cache:
            cache[name] = _train(tmp_path_factory.mktemp(name), nproc, *args)
        return cache[name]

    return run


def test_sp2_matches_one_process_and_evaluates(runs):
    want = runs("plain", 1, "--sp", "1", "--eval")
    got = runs("sp2", 2, "--sp", "2", "--eval", "--save-steps", "4")
    _assert_same_run(got, want)
    # The Trainer counts sequences per step over data-parallel groups, not SP ranks, and its
    # FLOPs estimate (one process and one SP group pad the batch alike) and tokens seen once.
    assert got["total_train_batch_size"] == want["total_train_batch_size"] == 8
    summary = [next(e for e in r["logs"] if "total_flos" in e) for r in (got, want)]
    assert summary[0]["total_flos"] == summary[1]["total_flos"]
    assert summary[0]["num_input_tokens_seen"] == summary[1]["num_input_tokens_seen"] > 0
    # A guard: the test can fail (a run with another learning rate does not pass it).
    with pytest.raises(AssertionError):
        _assert_same_run(runs("plain_other_lr", 1, "--sp", "1", "--lr", "2e-3"), want)


def test_dp2_sp2_matches_one_process(runs):
    got = runs("dp2sp2", 4, "--sp", "2")
    _assert_same_run(got, runs("plain", 1, "--sp", "1", "--eval") | {"eval_loss": None})
    assert got["total_train_batch_size"] == 8  # two DP groups of 4 sequences, not four ranks'


def test_the_first_step_verified_against_the_model_unsharded(runs):
    """verify_tolerance: before step 1 trains, its batch runs sharded and unsharded on every rank
    (ulysses.hf.verify); the run passes it and trains as before."""
    got = runs("dp2sp2_verified", 4, "--sp", "2", "--verify", "1e-5")
    _assert_same_run(got, runs("plain", 1, "--sp", "1", "--eval") | {"eval_loss": None})
    name, error = got["verified"]
    assert error <= 1e-5, (name, error)


def test_dp2_sp2_packed_with_gradient_accumulation(runs):
    want = runs("plain_packed", 1, "--sp", "1", "--packed", "--grad-accum", "2")
    _assert_same_run(runs("dp2sp2_packed", 4, "--sp", "2", "--packed", "--grad-accum", "2"), want)


def test_long_sequence_memory_features_match_one_process(runs):
    """Tiled MLP, tiled logits + loss (no logits), layers checkpointed with offload, at DP 2 x SP 2."""
    want = runs("plain", 1, "--sp", "1", "--eval")
    _assert_same_run(runs("dp2sp2_long", 4, "--sp", "2", "--long", "--eval"), want | {"eval_loss": None})


def test_resume_from_step_4_reproduces_steps_5_to_8(runs, tmp_path):
    full = runs("sp2", 2, "--sp", "2", "--eval", "--save-steps", "4")
    checkpoint = full["out"] / "checkpoint-4"
    assert (checkpoint / "trainer_state.json").exists(), sorted(p.name for p in full["out"].iterdir())
    resumed = _train(tmp_path, 2, "--sp", "2", "--eval", "--resume", str(checkpoint))
    _assert_same_run(resumed, full, steps=[5, 6, 7, 8])


def test_fsdp2_sp2_matches_one_process(runs):
    """FSDP2 by the TrainingArguments a GPU script passes (on CPU the mixin applies fully_shard)."""
    got = runs("sp2_fsdp", 2, "--sp", "2", "--fsdp")
    _assert_same_run(got, runs("plain", 1, "--sp", "1", "--eval") | {"eval_loss": None})
    # Sharded for real: each rank holds half the parameters, and the Trainer wrapped no DDP.
    assert got["held_share"] == 0.5 and got["wrapped"].startswith("FSDP"), (got["held_share"], got["wrapped"])


def test_fsdp2_dp2_sp2_packed_with_gradient_accumulation(runs):
    want = runs("plain_packed", 1, "--sp", "1", "--packed", "--grad-accum", "2")
    got = runs("dp2sp2_packed_fsdp", 4, "--sp", "2", "--packed", "--grad-accum", "2", "--fsdp")
    _assert_same_run(got, want)
    assert got["held_share"] == 0.25


def test_fsdp2_sp4_long_sequence_features_with_kv_replicated(runs):
    """SP 4 over 2 kv heads (each replicated on two ranks), tiled MLP and loss, layers checkpointed
    with offload, parameters sharded over the four ranks."""
    want = runs("plain", 1, "--sp", "1", "--eval")
    _assert_same_run(runs("sp4_long_fsdp", 4, "--sp", "4", "--long", "--fsdp"), want | {"eval_loss": None})


def test_fsdp2_resume_from_step_4_reproduces_steps_5_to_8(runs, tmp_path):
    """The mixin's own FSDP2 (CPU) checkpoints model and optimizer shards with torch's distributed
    checkpoint and resumes from them bit for bit; the checkpoint also holds the full weights."""
    from safetensors.torch import load_file

    full = runs("sp2_fsdp_saved", 2, "--sp", "2", "--fsdp", "--save-steps", "4")
    checkpoint = full["out"] / "checkpoint-4"
    assert (checkpoint / "ulysses_fsdp2").is_dir(), sorted(p.name for p in checkpoint.iterdir())
    resumed = _train(tmp_path, 2, "--sp", "2", "--fsdp", "--resume", str(checkpoint))
    _assert_same_run(resumed, full, steps=[5, 6, 7, 8])
    assert all(torch.equal(resumed["params"][k], w) for k, w in full["params"].items())
    weights = load_file(checkpoint / "model.safetensors")  # whole tensors, as save_pretrained writes them
    assert {k: w.shape for k, w in weights.items()} == {k: w.shape for k, w in full["params"].items()
                                                        if k in weights}
    assert weights["model.embed_tokens.weight"].shape == (32, 64)


def test_trl_sft_trainer_with_packing(runs):
    pytest.importorskip("trl", reason="TRL's SFTTrainer case needs trl (pip install trl)")
    want = runs("trl_plain", 1, "--sp", "1", "--trl", "--eval")
    _assert_same_run(runs("trl_sp2", 2, "--sp", "2", "--trl", "--eval"), want)


PREFERENCE_STEPS = 4


def _preference_run(tmp_path_factory, cache: dict, name: str, nproc: int, *args: str) -> dict:
    if name not in cache:
        pytest.importorskip("trl", reason="DPO and GRPO are TRL's trainers (pip install trl)")
        example = ROOT / "examples" / f"trl_{name.split('_')[0]}.py"
        cache[name] = _train(tmp_path_factory.mktemp(name), nproc, *args, example=example, steps=PREFERENCE_STEPS)
    return cache[name]


@pytest.fixture(scope="module")
def preference_runs(tmp_path_factory):
    cache: dict = {}
    return lambda name, nproc, *args: _preference_run(tmp_path_factory, cache, name, nproc, *args)


def test_trl_dpo_matches_one_process(preference_runs):
    """DPO (WholeSequenceLogProbs + TRL's DPOTrainer: policy and reference model sequence-parallel)
    at SP 2 with DDP and at DP 2 x SP 2 with FSDP2, against the plain one-process DPOTrainer on
    the same pairs of uneven lengths: every logged loss, the evaluation loss, the final
    parameters."""
    want = preference_runs("dpo_plain", 1, "--eval")
    _assert_same_run(preference_runs("dpo_sp2", 2, "--sp", "2", "--eval"), want)
    _assert_same_run(preference_runs("dpo_dp2_sp2_fsdp", 4, "--sp", "2", "--fsdp", "--eval"), want)


def test_trl_grpo_matches_the_plain_run(preference_runs):
    """GRPO (TRL generates on whole prompts, every log-probability pass sequence-parallel: the
    policy's, the old policy's ratio over two iterations, the reference model's KL): SP 2 against
    one process, DP 2 x SP 2 against plain DDP at DP 2 (the same completions: a DP rank samples
    the same numbers with SP as without)."""
    _assert_same_run(preference_runs("grpo_sp2", 2, "--sp", "2"), preference_runs("grpo_plain", 1))
    _assert_same_run(preference_runs("grpo_dp2_sp2", 4, "--sp", "2"), preference_runs("grpo_dp2", 2, "--sp", "1"))


def test_trl_rloo_matches_one_process(preference_runs):
    """RLOO shares GRPO's path (TRL's generation, the fused head's log-probabilities)."""
    _assert_same_run(preference_runs("grpo_rloo_sp2", 2, "--sp", "2", "--rloo"),
                     preference_runs("grpo_rloo_plain", 1, "--rloo"))


@pytest.mark.parametrize("model,nproc,extra", [("qwen3_next", 2, ()), ("bamba", 4, ("--fsdp",))])
def test_a_hybrid_model_trains_as_in_one_process(runs, model, nproc, extra):
    """Gated delta-nets (SP 2, DDP-free) and Mamba-2 layers with fewer B/C groups than heads
    (DP 2 x SP 2 under FSDP2) beside attention: every logged loss and the final parameters."""
    want = runs(f"plain_{model}", 1, "--sp", "1", "--model", model)
    _assert_same_run(runs(f"sp_{model}", nproc, "--sp", "2", "--model", model, *extra), want)


def test_the_trainer_needs_torch_distributed(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    from ulysses.trainer import SequenceParallelTrainer

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized; launch the script with torchrun"):
        SequenceParallelTrainer(model=model, args=args, sp_size=2)


@pytest.mark.parametrize("model,name,nproc,extra", [
    ("qwen2_5_vl", "sp2", 2, ()), ("qwen2_5_vl", "dp2_sp2", 4, ()), ("qwen2_5_vl", "dp2_sp2_fsdp", 4, ("--fsdp",)),
    ("gemma3", "dp2_sp2", 4, ()), ("gemma3", "dp2_sp2_fsdp", 4, ("--fsdp",)),
    ("qwen2_5_vl", "sp2_packed", 2, ("--packed",)), ("gemma3", "sp2_packed", 2, ("--packed",)),
    ("llava", "sp2", 2, ()), ("llava", "dp2_sp2_fsdp", 4, ("--fsdp",)),
    ("qwen2_5_vl", "dp2_sp2_long", 4, ("--long",)), ("gemma3", "sp2_long_fsdp", 2, ("--long", "--fsdp"))])
def test_a_vision_language_model_trains_as_in_one_process(runs, model, name, nproc, extra):
    """Qwen2.5-VL and Gemma 3, an image per row (every rank of an SP group gets the whole batch
    with its images): SP 2 under DDP, and DP 2 x SP 2 under DDP and FSDP2, where each SP group's
    batch is one row, so one rank of each encodes no frame or image (its tower still reduces zero
    gradients, as DDP and FSDP2 reduce the same parameters everywhere); Gemma 3's image blocks seen
    both ways; and the step's two rows packed into one (Qwen2.5-VL's positions [4, 1, S]), held to
    the padded single-process run, as each document attends only to itself; LLaVA under TRL's
    SFTTrainer, whose VLM collator runs LLaVA's processor (built here) on rows of an image file and
    text; and with every long-sequence feature (tiled MLP, the tiled loss, offloaded checkpoints):
    every logged loss and the final parameters."""
    vlm = ("--model", model, "--global-batch", "2")
    if model == "llava":
        pytest.importorskip("trl", reason="TRL's SFTTrainer case needs trl (pip install trl)")
        pytest.importorskip("PIL", reason="LLaVA's image processor needs pillow (pip install pillow)")
        vlm += ("--trl",)
    want = runs(f"plain_{model}", 1, "--sp", "1", *vlm)
    _assert_same_run(runs(f"{model}_{name}", nproc, "--sp", "2", *vlm, *extra), want)


@pytest.mark.parametrize("setting", [{"scale_rewards": "batch"}, {"multi_objective_aggregation": "normalize_then_sum"},
                                     {"normalize_advantages": True}, {"aux_loss_enabled": True}])
def test_what_whole_sequence_trainers_cannot_do_exactly_is_refused(setting):
    """Reward statistics over the whole gathered batch would count an SP group's copies, and a
    router loss is a shard's: refused at construction, with what to set instead."""
    from types import SimpleNamespace

    from ulysses.trainer import WholeSequenceLogProbs

    trainer = SimpleNamespace(args=SimpleNamespace(**{k: v for k, v in setting.items() if k != "aux_loss_enabled"}),
                              aux_loss_enabled=setting.get("aux_loss_enabled", False), sp_size=2)
    with pytest.raises(ValueError, match="router loss" if "aux_loss_enabled" in setting else "not supported"):
        WholeSequenceLogProbs._make_sequence_parallel(trainer, torch.nn.Linear(1, 1))


def _batch_wrong_on_rank_1(rank: int, group: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    from ulysses.trainer import SequenceParallelTrainer

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    import tempfile

    # As torchrun sets them (the group is up already: accelerate takes it as it is).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[])
        trainer = SequenceParallelTrainer(model=AutoModelForCausalLM.from_config(config), args=args, sp_size=2)
        batch = {"input_ids": torch.arange(8).remainder(16)[None]}
        if rank == 1:
            batch["pixel_values"] = torch.zeros(1, 3)
        try:
            trainer._sharded_forward(trainer.model, batch)
        except ValueError as e:
            return str(e)
    return ""


def test_a_batch_wrong_on_one_rank_fails_every_rank_alike(tmp_path):
    """Rank 1 alone gets a key the shard does not carry: both ranks raise its error, before the
    forward's collectives (rank 0 would otherwise wait in the first of them until its timeout)."""
    from conftest import run_processes

    errors = run_processes(2, _batch_wrong_on_rank_1, tmp_dir=str(tmp_path))
    assert errors[0] == errors[1]
    assert "the batch has ['pixel_values'], which the sequence shard does not carry" in errors[0]
