"""What the GPU path relies on, tested where there is no GPU: a group made for another device
alone gets a CPU backend for the agreement, and the batched transport is chosen per backend."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ulysses
import ulysses.training
from conftest import run_processes, seq_lens, shard
from reference import reference_attention


def _device_only_backend(store, rank, size, timeout):
    """A backend registered for CUDA tensors alone (Gloo underneath): the group it makes has no
    CPU backend, as a group made with backend="nccl" has none."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _attend_on_a_device_only_group(rank: int, world_name: str):
    dist.Backend.register_backend("ulysses_device_only", _device_only_backend, devices=["cuda"])
    group = dist.new_group(backend="ulysses_device_only")
    before = [d.type for d in group._device_types]
    attn = ulysses.DistributedAttention(group, causal=True)  # adds the CPU backend
    after = sorted(d.type for d in group._device_types)
    S, lens = 10, seq_lens(10, 2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = attn(*(shard(t, 1, rank, lens) for t in (q, k, v)), seq_lens=lens)
    err = (out - shard(reference_attention(q, k, v, causal=True), 1, rank, lens)).abs().max().item()
    return before, after, err


def test_a_group_without_a_cpu_backend_gets_one_for_the_agreement(tmp_path):
    """An NCCL-only group would move each call's agreement through the GPU (a device-to-host
    copy per call). DistributedAttention gives such a group a Gloo backend for CPU tensors,
    through the group's own store; the call then runs, exact. Without it the CPU tensors of
    this test would have no backend at all."""
    for before, after, err in run_processes(2, _attend_on_a_device_only_group, tmp_dir=str(tmp_path)):
        assert before == ["cuda"] and after == ["cpu", "cuda"], (before, after)
        assert err < 1e-12, err


def _helpers_on_a_device_only_group(rank: int, world_name: str):
    """Everything that names the group, after a DistributedAttention gave it its CPU backend."""
    from torch.distributed import _functional_collectives as funcol

    dist.Backend.register_backend("ulysses_device_only", _device_only_backend, devices=["cuda"])
    group = dist.new_group(backend="ulysses_device_only")
    name, description = group.group_name, group.group_desc
    S, V, lens = 10, 7, seq_lens(10, 2)
    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, V, (2, S), generator=gen)}
    before = ulysses.training.shard_batch(batch, group)
    q, k, v = (torch.randn(1, S, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = shard(reference_attention(q, k, v, causal=True), 1, rank, lens)
    mine = [shard(t, 1, rank, lens) for t in (q, k, v)]
    errors = {}
    for i in range(2):  # the second instance finds the group by the same name
        errors[f"attention {i}"] = (ulysses.DistributedAttention(group, causal=True)(*mine) - want).abs().max().item()
    # The loss helpers: the global token mean, from this rank's logits.
    logits = torch.randn(2, S, V, generator=gen, dtype=torch.float64)
    labels = ulysses.training.shard_batch(batch, group)["shift_labels"]
    full_labels = torch.cat([batch["input_ids"][:, 1:], torch.full((2, 1), -100)], 1)
    mean = torch.nn.functional.cross_entropy(logits.flatten(0, 1), full_labels.flatten(), ignore_index=-100)
    _, got = ulysses.training.sequence_parallel_loss(shard(logits, 1, rank, lens), labels, group)
    errors["sequence_parallel_loss"] = abs(got.item() - mean.item())
    token_sum = torch.nn.functional.cross_entropy(shard(logits, 1, rank, lens).flatten(0, 1), labels.flatten(),
                                                  ignore_index=-100, reduction="sum")
    errors["token_mean"] = abs(ulysses.training.token_mean(token_sum, labels, group)[1].item() - mean.item())
    # Gradients summed over the group.
    layer = torch.nn.Linear(3, 1, bias=False).double()
    layer.weight.grad = torch.full((1, 3), float(rank + 1), dtype=torch.float64)
    ulysses.all_reduce_gradients(layer, group)
    errors["all_reduce_gradients"] = (layer.weight.grad - 3.0).abs().max().item()
    # shard_batch again, and the Trainer's gather of logits along the sequence.
    again = ulysses.training.shard_batch(batch, group)
    errors["shard_batch"] = max((again[key] != before[key]).sum().item() for key in ("input_ids", "shift_labels"))
    lens_seen = ulysses.ops.sequence_lengths(shard(logits, 1, rank, lens), 1, group)
    whole = ulysses.ops.all_gather_sequence(shard(logits, 1, rank, lens), 1, lens_seen, group)
    errors["gather"] = (whole - logits).abs().max().item()
    # torch's own functional collectives find the group by its name too.
    errors["functional all_reduce"] = (funcol.all_reduce(torch.ones(2), "sum", group).wait() - 2).abs().max().item()
    return (group.group_name, group.group_desc), (name, description), errors


def test_a_device_only_group_keeps_its_name_and_every_helper_stays_exact(tmp_path):
    """Registering the CPU backend used to clear the group's name (c10d reads it from one backend,
    and the new one had none): a second DistributedAttention then ran as this rank alone and the
    loss and gradient helpers did nothing, without an error."""
    for now, then, errors in run_processes(2, _helpers_on_a_device_only_group, tmp_dir=str(tmp_path)):
        assert now == then and then[0], (now, then)
        assert all(err < 1e-6 for err in errors.values()), errors


def _unnamed_group(rank: int, world_name: str):
    group = dist.new_group()
    group._set_group_name("")
    try:
        ulysses.DistributedAttention(group)
    except ValueError as e:
        return str(e)
    return ""


def test_a_process_group_without_a_name_is_refused(tmp_path):
    for rank, message in enumerate(run_processes(2, _unnamed_group, tmp_dir=str(tmp_path))):
        assert f"the process group of rank {rank} of 2 has no name" in message, message


def _side_backend_timeouts(rank: int, world_name: str):
    import datetime

    dist.Backend.register_backend("ulysses_device_only", _device_only_backend, devices=["cuda"])
    group = dist.new_group(backend="ulysses_device_only", timeout=datetime.timedelta(seconds=300))
    seen = []
    for timeout in (10, 500, 20):
        ulysses.DistributedAttention(group, timeout=timeout)
        seen.append(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    return seen


def test_the_cpu_backend_waits_as_long_as_the_group_and_the_longest_caller(tmp_path):
    """The added Gloo backend used to wait 120 s whatever the job allowed (NCCL's default is 10
    minutes): a rank two minutes late (a checkpoint, an evaluation, a first compile) ended the job."""
    for seen in run_processes(2, _side_backend_timeouts, tmp_dir=str(tmp_path)):
        assert seen == [300.0, 500.0, 500.0], seen


def _autosp_on_a_device_only_group(rank: int, world_name: str):
    dist.Backend.register_backend("ulysses_device_only", _device_only_backend, devices=["cuda"])
    group = dist.new_group(backend="ulysses_device_only")
    name = group.group_name
    ulysses.autosp(group)
    return sorted(d.type for d in group._device_types), group.group_name == name


def test_autosp_gives_a_device_only_group_its_cpu_backend_too(tmp_path):
    for devices, name_kept in run_processes(2, _autosp_on_a_device_only_group, tmp_dir=str(tmp_path)):
        assert devices == ["cpu", "cuda"] and name_kept, devices


def _verify_on_a_device_only_group(rank: int, world_name: str):
    """ulysses.hf.verify over a group with no CPU backend of its own (as NCCL's): it gives the group
    its side backend first, and runs the unsharded reference on the model itself (a forward hook
    sees which embedding modules ran: a copy of the model would show a second one)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ulysses.hf as uhf

    dist.Backend.register_backend("ulysses_device_only", _device_only_backend, devices=["cuda"])
    group = dist.new_group(backend="ulysses_device_only")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = uhf.sequence_parallel(AutoModelForCausalLM.from_config(config).double(), group)
    ran = set()
    model.get_input_embeddings().register_forward_hook(lambda module, *_: ran.add(id(module)))
    gen = torch.Generator().manual_seed(1)
    result = uhf.verify(model, {"input_ids": torch.randint(0, 16, (2, 11), generator=gen)}, group, tolerance=1e-10)
    return sorted(d.type for d in group._device_types), ran == {id(model.get_input_embeddings())}, result.worst[1]


def test_verify_runs_on_a_device_only_group_without_a_second_model(tmp_path):
    for devices, one_model, worst in run_processes(2, _verify_on_a_device_only_group, tmp_dir=str(tmp_path)):
        assert devices == ["cpu", "cuda"] and one_model and worst < 1e-10, (devices, one_model, worst)
