"""FSDP2 (``fully_shard`` over every rank) with sequence parallelism over an SP sub-group, in a
plain loop on process ranks: every logged loss, every gradient and the final full parameters
equal one process training on the whole batch. The loss helper's ``gradients="averaged"`` is
what makes them equal; the DDP-style sum (``"summed"``) under FSDP is caught."""

from __future__ import annotations

import pytest
import torch

from conftest import run_example, run_processes

S, VOCAB, STEPS = 13, 61, 2


def make_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0, use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def batches(rows: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (rows, S), generator=gen) for _ in range(STEPS)]


def reference(rows: int):
    """One process, the whole batch: per step the loss, then the final parameters (SGD)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first_grads = [], None
    for ids in batches(rows):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        first_grads = first_grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def fsdp_body(rank, world_name, sp, rows, gradients):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import ulysses.hf as uhf

    world = dist.get_world_size()
    sp_group, _ = dist.new_subgroups_by_enumeration([list(range(d, d + sp)) for d in range(0, world, sp)])
    dp_rank, per_replica = rank // sp, rows // (world // sp)
    model = uhf.sequence_parallel(make_model(), sp_group)
    for layer in model.model.layers:
        fully_shard(layer)  # Parameters sharded over every rank, SP ranks included.
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first_grads = [], None
    for ids in batches(rows):
        mine = {"input_ids": ids[dp_rank * per_replica:(dp_rank + 1) * per_replica]}
        shard = uhf.shard_batch(mine, sp_group)
        optimizer.zero_grad()
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                       ulysses_seq_lens=shard["seq_lens"]).logits
        # Normalised over every rank's tokens (the global batch); FSDP averages over every rank.
        loss, mean = uhf.sequence_parallel_loss(logits, shard["shift_labels"], dist.group.WORLD,
                                                gradients=gradients)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(mean.item())
    return losses, first_grads, {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("world,sp,rows", [(2, 2, 2), (4, 2, 4)], ids=["sp2", "dp2xsp2"])
def test_fsdp2_with_sequence_parallelism_equals_one_process(world, sp, rows, tmp_path):
    want_losses, want_grads, want_params = reference(rows)
    for losses, grads, params in run_processes(world, fsdp_body, sp, rows, "averaged", tmp_dir=str(tmp_path)):
        for got, want in zip(losses, want_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (losses, want_losses)
        for name, want in want_grads.items():
            assert rel(grads[name], want) <= 1e-5, name
        for name, want in want_params.items():
            assert rel(params[name], want) <= 1e-5, name


def test_the_summed_scaling_under_fsdp2_is_caught(tmp_path):
    """The DDP-style sum's loss under FSDP's average: every gradient is 1/world of the truth."""
    _, want_grads, _ = reference(2)
    for _, grads, _ in run_processes(2, fsdp_body, 2, 2, "summed", tmp_dir=str(tmp_path)):
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
