"""A collective's wait under the conditions people train in (Note [One wait] in ulysses/groups.py):
every public ``timeout=`` is a timedelta or a number of seconds, an int or a float alike, on every
path; without one a wait is the group's own; a rank late by more than a second but less than the
wait finishes with the exact result, and one later than the group allows fails every rank."""

from __future__ import annotations

import copy
import datetime
import math
import os
import time

import pytest
import torch

import ulysses
import ulysses.hf as uhf
from conftest import run_processes, run_ranks, run_ranks_errors, seq_lens, shard
from reference import reference_attention
from ulysses import groups as G

LATE_S = 1.3  # how late rank 1 comes: far beyond 5 ms, well inside 5 s
# The same wait of 5 s in each form a user may give it.
TIMEOUTS = {"int": 5, "float": 5.0, "timedelta": datetime.timedelta(seconds=5)}


def test_a_timeout_is_read_once_as_seconds():
    for given in TIMEOUTS.values():
        assert G.wait(given) == G.Wait(5000)
    assert G.wait(0.25) == G.Wait(250) and G.wait(None) == G.Wait()
    assert G.wait(G.Wait(7)) == G.Wait(7)  # (a Wait, read already, passes through)
    assert G.Wait().options() == [-1] and G.Wait(30000).options() == [30000]
    assert G.group_options(30) == [30000]  # once read as 30 ms on some paths


@pytest.mark.parametrize("bad,error", [("30", TypeError), (True, TypeError), ([30], TypeError), (0, ValueError),
                                       (-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError)])
def test_a_timeout_that_is_not_seconds_is_refused_with_what_to_give(bad, error):
    with pytest.raises(error, match="timeout must be a"):
        G.wait(bad)
    with pytest.raises(error, match="timeout must be a"):
        ulysses.DistributedAttention("", timeout=bad)
    with pytest.raises(error, match="timeout must be a"):
        ulysses.ops.sequence_lengths(torch.zeros(1, 4), 1, "", bad)


def _late(rank: int) -> None:
    if rank == 1:
        time.sleep(LATE_S)


def _late_before(module: torch.nn.Module, rank: int) -> None:
    """Rank 1 reaches ``module``'s forward LATE_S late (once)."""
    if rank == 1:
        def once(*_):
            handle.remove()
            time.sleep(LATE_S)  # (and returns None: the inputs stay as they are)

        handle = module.register_forward_pre_hook(once)


@pytest.mark.parametrize("form", list(TIMEOUTS))
def test_a_late_rank_inside_the_timeout_attends_exactly(form):
    S, lens = 12, seq_lens(12, 2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = reference_attention(q, k, v, causal=True)

    def body(rank, group):
        attention = ulysses.DistributedAttention(group, causal=True, timeout=TIMEOUTS[form])
        x = [shard(t, 1, rank, lens) for t in (q, k, v)]
        _late(rank)
        o = attention(*x)
        _late(rank)
        whole = ulysses.ops.all_gather_sequence(o, 1, lens, group, TIMEOUTS[form])
        return (whole - want).abs().max().item()

    assert max(run_ranks(2, body)) < 1e-12


def _sharded_model_step(name: str, form: str, late_at: str, tiled_loss: bool = False):
    """One step of a small HF model at P = 2 with rank 1 late at ``late_at`` (a module path of
    the model), against the unsharded model."""
    from test_hf import assert_matches, make_batch, reference, sharded_step

    if name == "qwen3_next":
        from test_hybrid import make_model
    else:
        from test_hf import make_model
    base = make_model(name)
    batch = make_batch("padded")
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group, timeout=TIMEOUTS[form], tiled_loss=tiled_loss)
        _late_before(model.get_submodule(late_at), rank)
        if not tiled_loss:
            return sharded_step(model, batch, group)
        sb = uhf.shard_batch(batch, group)
        out = model(input_ids=sb["input_ids"], attention_mask=sb.get("attention_mask"),
                    position_ids=sb["position_ids"], ulysses_seq_lens=sb["seq_lens"],
                    ulysses_shift_labels=sb["shift_labels"])
        loss, global_loss = uhf.token_mean(out.loss, sb["shift_labels"], group)
        loss.backward()
        uhf.all_reduce_gradients(model, group)
        return global_loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    for got in run_ranks(2, body):
        assert_matches(got, want)


@pytest.mark.parametrize("form", list(TIMEOUTS))
@pytest.mark.parametrize("path,name,late_at,tiled", [
    ("attention", "llama", "model.layers.1", False),
    ("hybrid mixer", "qwen3_next", "model.layers.0", False),  # its gated delta-net's exchange
    ("tiled loss", "llama", "model.norm", True),  # the loss's label round, after the layers
])
def test_a_late_rank_inside_the_timeout_trains_exactly(path, name, late_at, tiled, form):
    _sharded_model_step(name, form, late_at, tiled)


@pytest.mark.parametrize("form", list(TIMEOUTS))
def test_a_late_rank_inside_the_timeout_encodes_images_exactly(form):
    """Qwen2-VL: rank 1 reaches the vision tower's gather of frames late."""
    from test_vision import assert_matches, make_batch, make_model, reference, sharded_step

    base = make_model("qwen2_vl")
    batch = make_batch("image", 7)
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group, timeout=TIMEOUTS[form])
        _late_before(model.model.visual, rank)
        return sharded_step(model, batch, group)

    for got in run_ranks(2, body):
        assert_matches(got, want)


def _autosp_with_a_late_rank(rank: int, group: str):
    """AutoSP's agreement and exchanges with rank 1 late at each step, a wait in each form."""
    from test_autosp import batch, compare, plain_gqa_model, reference, sp_step

    errors = {}
    for form, timeout in TIMEOUTS.items():
        torch._dynamo.reset()
        model = plain_gqa_model()
        ids, labels, attention_mask = batch()
        ref = reference(model, ids, labels, attention_mask)
        _late(rank)
        loss = sp_step(model, ulysses.autosp(group, timeout=timeout), ulysses.mark_sequence(ids.clone()), labels,
                       attention_mask)
        errors[form] = compare(model, *ref, loss, group)
    return errors


def test_a_late_rank_inside_the_timeout_compiles_and_runs_autosp(tmp_path):
    for errors in run_processes(2, _autosp_with_a_late_rank, tmp_dir=str(tmp_path)):
        assert set(errors) == set(TIMEOUTS) and all(max(e) < 1e-5 for e in errors.values()), errors


def test_without_a_timeout_a_wait_is_the_groups_own():
    """A group made with a 3 s timeout: a rank 1.3 s late at an attention call finishes exactly;
    one 6 s late fails every rank with the group's timeout (not 120 s, nor anything else)."""
    S, lens = 8, seq_lens(8, 2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    want = reference_attention(q, k, v)

    def call(late_s: float):
        def body(rank, group):
            attention = ulysses.DistributedAttention(group)
            x = [shard(t, 1, rank, lens) for t in (q, k, v)]
            if rank == 1:
                time.sleep(late_s)
            return (attention(*x) - shard(want, 1, rank, lens)).abs().max().item()
        return body

    assert max(run_ranks(2, call(LATE_S), timeout_s=3.0)) < 1e-12
    errors = run_ranks_errors(2, call(6.0), timeout_s=3.0)
    assert all("(timeout 3000 ms" in e for e in errors), errors


def _trainer_waits(rank: int, group: str, ddp_timeout: int, timeout):
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    from ulysses.trainer import SequenceParallelTrainer

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    batch = {"input_ids": torch.arange(9).remainder(16)[None], "labels": torch.arange(9).remainder(16)[None]}
    with torch.no_grad():
        want = model(**batch).loss.item()  # the unsharded token mean
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], ddp_timeout=ddp_timeout)
        trainer = SequenceParallelTrainer(model=model, args=args, sp_size=2, timeout=timeout)
        _late(rank)  # late at the step's first round
        loss = trainer.compute_loss(trainer.model, batch)
    waits = {m.__dict__.get("_ulysses_timeout") for m in model.modules()}
    return trainer._wait, waits, loss.item(), want


@pytest.mark.parametrize("timeout,want", [(None, G.Wait(5000)), (9, G.Wait(9000)), (9.5, G.Wait(9500)),
                                          (datetime.timedelta(seconds=8), G.Wait(8000))])
def test_the_trainer_waits_as_long_as_its_ddp_timeout_unless_told(tmp_path, timeout, want):
    """The Trainer's ddp_timeout (5 s here, 30 minutes by default) bounds every wait of the
    library's, the attention's included; an explicit timeout wins. A rank 1.3 s late finishes."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install accelerate)")
    results = run_processes(2, _trainer_waits, 5, timeout, tmp_dir=str(tmp_path))
    for wait, waits, _, _ in results:
        assert wait == want and waits == {want}, (wait, waits)
    # Each rank's loss is its shard's share of the mean, times the world (DDP averages).
    mean = sum(loss for _, _, loss, _ in results) / 2
    assert abs(mean - results[0][3]) <= 1e-5 * results[0][3], (mean, results[0][3])


def _dpo_with_a_late_rank(rank: int, group: str):
    """One DPO step at SP 2 (WholeSequenceLogProbs: the policy's and the reference model's
    whole-sequence passes) per form of the wait, rank 1 late at the policy's first layer."""
    import sys
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import DPOConfig

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from hf_trainer import word_tokenizer
    from trl_dpo import SequenceParallelDPOTrainer, preference_rows

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    losses = {}
    for form, timeout in TIMEOUTS.items():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="ulysses")
        with tempfile.TemporaryDirectory() as out:
            args = DPOConfig(output_dir=out, max_steps=1, per_device_train_batch_size=2, logging_steps=1,
                             report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no")
            trainer = SequenceParallelDPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                                                 train_dataset=Dataset.from_list(preference_rows(2, 32, seed=1)),
                                                 processing_class=word_tokenizer(32), sp_size=2, timeout=timeout)
            _late_before(model.model.layers[0], rank)
            trainer.train()
        losses[form] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses


def test_a_late_rank_inside_the_timeout_trains_dpo(tmp_path):
    pytest.importorskip("trl", reason="DPO is TRL's trainer (pip install trl)")
    ranks = run_processes(2, _dpo_with_a_late_rank, tmp_dir=str(tmp_path))
    assert ranks[0] == ranks[1], ranks  # every rank of the group logs the group's loss
    assert len({tuple(v) for v in ranks[0].values()}) == 1, ranks  # the same step in each form
