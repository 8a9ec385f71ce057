"""Hybrid models (attention among gated delta-nets, Mamba-2 layers or short convolutions) under
ulysses.hf on thread ranks: loss and every parameter gradient equal transformers' own
single-process model (its torch kernels), through one exchange each way per mixer."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import ulysses
import ulysses.hf as uhf
from conftest import run_ranks, run_ranks_errors, seq_lens, set_up_links, shard
from test_hf import VOCAB, assert_matches, make_batch, reference, sharded_step

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, use_cache=False, max_position_embeddings=64)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
# Heads chosen so that P = 2 and 3 split them unevenly and P = 3 has fewer key heads (groups)
# than ranks: 6 value heads over 2 key heads (delta-nets), 8 Mamba heads over 2 groups.
DELTA_NET = dict(linear_num_value_heads=6, linear_num_key_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
                 linear_conv_kernel_dim=4)
MAMBA = dict(mamba_n_heads=8, mamba_n_groups=2, mamba_d_head=4, mamba_d_state=4, mamba_expand=1, mamba_chunk_size=8,
             mamba_d_conv=4)
CONFIGS = {
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        layer_types=["linear_attention", "full_attention"], num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, **DELTA_NET, **ATTENTION, **COMMON),
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
        layer_types=["linear_attention", "full_attention"], num_hidden_layers=2, **DELTA_NET, **ATTENTION, **COMMON),
    "bamba": lambda: transformers.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1], **MAMBA,
                                              num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        layer_types=["mamba", "attention"], num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=16, **MAMBA, num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "nemotron_h": lambda: transformers.NemotronHConfig(
        layers_block_type=["mamba", "attention", "mlp"], mamba_num_heads=8, n_groups=2, mamba_head_dim=4,
        ssm_state_size=4, expand=1, chunk_size=8, conv_kernel=4, **ATTENTION, **COMMON),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
        layer_types=["linear_attention", "full_attention"], num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, **DELTA_NET, **ATTENTION, **COMMON),
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(
        layer_types=["conv", "full_attention"], num_hidden_layers=2, num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, conv_L_cache=3, num_attention_heads=4, num_key_value_heads=2,
        **COMMON),
    "lfm2": lambda: transformers.Lfm2Config(layer_types=["conv", "full_attention"], num_hidden_layers=2,
                                            conv_L_cache=3, num_attention_heads=4, num_key_value_heads=2, **COMMON),
}


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").float()
    with torch.no_grad():  # Slow decays, so each token's state reaches far across shard boundaries
        for module in model.modules():  # (initialised, A up to 16 forgets within a few tokens).
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.02, 0.3).log())
    return model


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("kind", ["padded", "plain"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_every_gradient_equal_the_unsharded_model(name, kind, P):
    base = make_model(name)
    batch = make_batch(kind)
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(P)]

    def body(rank, group):
        uhf.sequence_parallel(models[rank], group)
        return sharded_step(models[rank], batch, group)

    for got in run_ranks(P, body):
        assert_matches(got, want)


@pytest.mark.parametrize("name,layer,each_way", [("qwen3_next", "linear_attn", (3, 2)), ("bamba", "mamba", (3, 2)),
                                                 ("lfm2", "conv", (2, 1))])
def test_one_exchange_each_way_per_mixer(name, layer, each_way):
    """A mixer layer's forward issues one agreement round and one exchange each way (the heads
    out in one fused all-to-all, the output back in one), its backward one each way; a short
    convolution's, one agreement and one all-gather of the tokens before the shard."""
    base = make_model(name)
    models = [copy.deepcopy(base) for _ in range(2)]
    lens = seq_lens(13, 2)
    x = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(3))

    def body(rank, group):
        mixer = getattr(uhf.sequence_parallel(models[rank], group).model.layers[0], layer)
        xs = shard(x, 1, rank, lens).requires_grad_()
        set_up_links(group, 2)
        before = ulysses._C.collective_count(group)
        y = mixer(xs, ulysses_seq_lens=lens)
        forward = ulysses._C.collective_count(group) - before
        y.square().sum().backward()
        return forward, ulysses._C.collective_count(group) - before - forward

    assert run_ranks(2, body) == [each_way] * 2


@pytest.mark.parametrize("name,change,message", [
    ("qwen3_next", dict(linear_num_value_heads=4), "ranks disagree on q_heads"),
    ("bamba", dict(mamba_n_groups=1), "ranks disagree on kv_heads"),
    ("lfm2", dict(conv_L_cache=4), "ranks disagree"),
])
def test_one_ranks_mixer_config_differs_and_every_rank_raises_alike(name, change, message):
    base = make_model(name)
    other = CONFIGS[name]()
    for key, value in change.items():
        setattr(other, key, value)
    torch.manual_seed(0)
    odd = AutoModelForCausalLM.from_config(other, attn_implementation="eager").float()
    models = [base, odd]
    batch = make_batch("plain")

    def body(rank, group):
        uhf.sequence_parallel(models[rank], group)
        sharded_step(models[rank], batch, group)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] != "" and message in errors[0], errors


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_one_ranks_sequence_split_differs_and_every_rank_raises_alike(name):
    base = make_model(name)
    models = [copy.deepcopy(base) for _ in range(2)]
    batch = make_batch("plain")

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group)
        sb = uhf.shard_batch(batch, group)
        lens = sb["seq_lens"] if rank == 0 else sb["seq_lens"][::-1]  # 7 + 6 on rank 0, 6 + 7 on rank 1
        model(input_ids=sb["input_ids"], position_ids=sb["position_ids"], ulysses_seq_lens=lens)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] != "", errors


@pytest.mark.parametrize("name", ["qwen3_next", "bamba", "lfm2"])
@pytest.mark.parametrize("boundary", [3, 9])  # a document starting on rank 0's shard, or rank 1's only
def test_packed_rows_are_refused_alike_on_every_rank(name, boundary):
    base = make_model(name)
    models = [copy.deepcopy(base) for _ in range(2)]
    batch = make_batch("plain")
    batch["position_ids"] = torch.cat([torch.arange(boundary), torch.arange(13 - boundary)]).expand(2, 13)

    def body(rank, group):
        uhf.sequence_parallel(models[rank], group)
        sharded_step(models[rank], batch, group)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and f"{type(base).__name__} got packed rows" in errors[0], errors


@pytest.mark.parametrize("name", ["qwen3_next", "granitemoehybrid", "lfm2"])
def test_verify_and_unsharded_take_hybrids(name):
    """ulysses.hf.verify checks a hybrid against itself unsharded in one call; inside
    unsharded(model) its mixers run their own forward on whole sequences, with no collective."""
    base = make_model(name)
    batch = make_batch("padded")
    models = [copy.deepcopy(base) for _ in range(2)]
    with torch.no_grad():
        want = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group)
        result = uhf.verify(model, batch, group, tolerance=1e-5)
        before = ulysses._C.collective_count(group)
        with uhf.unsharded(model), torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return result.worst[1], ulysses._C.collective_count(group) - before, logits

    for worst, collectives, logits in run_ranks(2, body):
        assert worst <= 1e-5 and collectives == 0
        torch.testing.assert_close(logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "lfm2"])
def test_the_hybrid_example_verifies_and_trains(family):
    from conftest import run_example

    r = run_example("hf_hybrid.py", 2, "--family", family, "--seq-len", "31", "--steps", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "verify: loss relative error" in r.stdout and f"{family} step 2/2 loss" in r.stdout, r.stdout
