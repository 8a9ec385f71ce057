"""FSDP2 (``fully_shard`` over every rank) with sequence parallelism over an SP sub-group, in a
plain loop on process ranks: every logged loss, the first step's gradients and the final full
parameters equal one process training on the whole batch. The loss helper's
``gradients="averaged"`` is what makes them equal; the DDP-style sum (``"summed"``) under FSDP is
caught. Variants: DP 2 x SP 2 with gradient accumulation, packed documents, GQA with the one kv
head replicated, the tiled MLP and loss with recomputed layers, and a resume from a sharded
checkpoint (torch.distributed.checkpoint)."""

from __future__ import annotations

import pytest
import torch

from conftest import run_example, run_processes

S, VOCAB, STEPS = 13, 61, 2


def make_model(kv_heads: int = 2):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attention_dropout=0.0, use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def batches(rows: int, micro: int, packed: bool) -> list[list[dict]]:
    """STEPS steps of ``micro`` micro-batches of ``rows`` sequences each."""
    gen = torch.Generator().manual_seed(1)
    positions = torch.cat([torch.arange(5), torch.arange(4), torch.arange(4)]).expand(rows, S)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(micro):
            batch = {"input_ids": torch.randint(0, VOCAB, (rows, S), generator=gen)}
            if packed:
                batch["position_ids"] = positions
            step.append(batch)
        out.append(step)
    return out


def reference(rows: int, micro: int = 1, packed: bool = False, kv_heads: int = 2):
    """One process, the whole batch: per step the loss (micro-batch losses averaged), the first
    step's gradients, the final parameters (SGD)."""
    model = make_model(kv_heads)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first_grads = [], None
    for step in batches(rows, micro, packed):
        optimizer.zero_grad()
        total = 0.0
        for batch in step:
            loss = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"),
                         labels=batch["input_ids"]).loss / micro
            loss.backward()
            total += loss.item()
        first_grads = first_grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(total)
    return losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded_model(sp_group, kv_heads: int, long: dict):
    from torch.distributed.fsdp import fully_shard

    import ulysses.hf as uhf

    model = uhf.sequence_parallel(make_model(kv_heads), sp_group, **long)
    for layer in model.model.layers:
        fully_shard(layer)  # Parameters sharded over every rank, SP ranks included.
    fully_shard(model)
    return model


def _train_step(model, optimizer, step, sp_group, dp_rank, per_replica, gradients, tiled_loss):
    """One optimizer step over the micro-batches of ``step``: returns the global mean loss."""
    import torch.distributed as dist

    import ulysses.hf as uhf

    optimizer.zero_grad()
    total = 0.0
    for batch in step:
        mine = {k: v[dp_rank * per_replica:(dp_rank + 1) * per_replica] for k, v in batch.items()}
        shard = uhf.shard_batch(mine, sp_group)
        inputs = dict(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                      ulysses_seq_lens=shard["seq_lens"])
        # Normalised over every rank's tokens (the global batch); FSDP averages over every rank.
        if tiled_loss:
            token_sum = model(**inputs, ulysses_shift_labels=shard["shift_labels"]).loss
            loss, mean = uhf.token_mean(token_sum, shard["shift_labels"], dist.group.WORLD, gradients=gradients)
        else:
            logits = model(**inputs).logits
            loss, mean = uhf.sequence_parallel_loss(logits, shard["shift_labels"], dist.group.WORLD,
                                                    gradients=gradients)
        (loss / len(step)).backward()
        total += mean.item() / len(step)
    optimizer.step()
    return total


def fsdp_body(rank, world_name, sp, rows, gradients, case):
    """Trains STEPS steps under FSDP2 x SP; ``case``: micro, packed, kv_heads, long (the
    sequence_parallel options), resume (save after step 1, continue in a fresh model from the
    sharded checkpoint at ``case["resume"]``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    world = dist.get_world_size()
    sp_group, _ = dist.new_subgroups_by_enumeration([list(range(d, d + sp)) for d in range(0, world, sp)])
    dp_rank, per_replica = rank // sp, rows // (world // sp)
    long = case.get("long", {})

    def fresh():
        model = _sharded_model(sp_group, case.get("kv_heads", 2), long)
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    model, optimizer = fresh()
    losses, first_grads = [], None
    for i, step in enumerate(batches(rows, case.get("micro", 1), case.get("packed", False))):
        if i == 1 and case.get("resume"):  # Save the sharded state, then go on in a fresh model.
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=case["resume"])
            model, optimizer = fresh()
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=case["resume"])
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        losses.append(_train_step(model, optimizer, step, sp_group, dp_rank, per_replica, gradients,
                                  long.get("tiled_loss", False)))
        if first_grads is None:
            first_grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    # The model as one ordinary state dict (what an export saves): rank 0 holds it.
    export = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert export.keys() == params.keys()
        assert all(type(t) is torch.Tensor and torch.equal(t, params[n]) for n, t in export.items())
    return losses, first_grads, params


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def assert_same_run(got, want):
    want_losses, want_grads, want_params = want
    for losses, grads, params in got:
        for a, b in zip(losses, want_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, want_losses)
        for name, g in want_grads.items():
            assert rel(grads[name], g) <= 1e-5, name
        for name, p in want_params.items():
            assert rel(params[name], p) <= 1e-5, name


CASES = {
    "sp2": (2, 2, 2, {}),
    "dp2xsp2_accumulated": (4, 2, 4, {"micro": 2}),
    "sp2_packed_gqa_replicated_tiled_recompute": (
        2, 2, 2, {"packed": True, "kv_heads": 1,
                  "long": {"tiled_mlp": True, "tiled_loss": True, "checkpoint": "recompute", "mlp_tile_tokens": 3}}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp2_with_sequence_parallelism_equals_one_process(name, tmp_path):
    world, sp, rows, case = CASES[name]
    want = reference(rows, case.get("micro", 1), case.get("packed", False), case.get("kv_heads", 2))
    assert_same_run(run_processes(world, fsdp_body, sp, rows, "averaged", case, tmp_dir=str(tmp_path)), want)


def test_a_resume_from_a_sharded_checkpoint_equals_the_uninterrupted_run(tmp_path):
    want = reference(2)
    case = {"resume": str(tmp_path / "checkpoint")}
    got = run_processes(2, fsdp_body, 2, 2, "averaged", case, tmp_dir=str(tmp_path))
    assert_same_run(got, want)
    assert (tmp_path / "checkpoint" / ".metadata").exists()


def test_the_summed_scaling_under_fsdp2_is_caught(tmp_path):
    """The DDP-style sum's loss under FSDP's average: every gradient is 1/world of the truth."""
    _, want_grads, _ = reference(2)
    for _, grads, _ in run_processes(2, fsdp_body, 2, 2, "summed", {}, tmp_dir=str(tmp_path)):
        name = "model.embed_tokens.weight"
        assert rel(grads[name], want_grads[name]) > 0.4
        assert rel(2 * grads[name], want_grads[name]) <= 1e-5


def test_an_unknown_gradient_reduction_is_named():
    import ulysses.hf as uhf

    with pytest.raises(ValueError, match="gradients must be one of 'summed', 'averaged'; got 'mean'"):
        uhf.sequence_parallel_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), "", gradients="mean")


def test_the_fsdp_example_trains_dp2_x_sp2_under_torchrun():
    r = run_example("hf_fsdp.py", 4, "--sp", "2", "--seq-len", "31", "--steps", "3", timeout_s=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world 4 = dp 2 x sp 2" in r.stdout and "held per rank" in r.stdout, r.stdout
    assert "step 3/3 loss" in r.stdout, r.stdout
