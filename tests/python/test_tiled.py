"""ulysses.tiled (tiled MLP, tiled logits + loss, checkpointed layers with host offload) against
the untiled computation in the same test, and ulysses.hf's long-sequence options on real Llama,
Qwen3 and Gemma2 models at P = 1, 2, 3 against the plain single-process model."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import ulysses.hf as uhf
import ulysses.tiled as T
from conftest import run_ranks, run_ranks_errors
from test_hf import assert_matches, make_batch, make_model, reference

TOL = 1e-6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def grads(y: torch.Tensor, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(y, xs))


# ---- tile counts ------------------------------------------------------------------------------


def test_the_tile_count_follows_the_largest_rank():
    assert T.tile_count([7, 6], 2) == 4 == T.tile_count(7, 2)  # the rank with 6 rows runs 4 tiles too
    assert T.tile_count([0], 5) == 1
    assert T._tile_bounds(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert T._tile_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError, match="tile_rows must be >= 1"):
        T.tile_count(4, 0)


# ---- logits + loss ----------------------------------------------------------------------------


@pytest.mark.parametrize("scale,softcap", [(1.0, 0.0), (0.7, 3.0)])
@pytest.mark.parametrize("tiles", [1, 4, 37, 40])  # uneven tiles; more tiles than rows
def test_linear_cross_entropy_equals_the_untiled_loss(tiles, scale, softcap):
    gen = torch.Generator().manual_seed(0)
    N, E, V = 37, 16, 50
    h = torch.randn(N, E, generator=gen, requires_grad=True)
    w = torch.randn(V, E, generator=gen, requires_grad=True)
    b = torch.randn(V, generator=gen, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=gen)
    y[3] = -100
    y[27:37] = -100  # at 4 tiles, the last tile (28..36) scores nothing
    z = torch.nn.functional.linear(h, w, b) * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    want = torch.nn.functional.cross_entropy(z, y, reduction="sum")
    got = T.linear_cross_entropy(h, w, y, bias=b, tiles=tiles, scale=scale, softcap=softcap)
    assert rel(got, want) <= TOL
    for g, r in zip(grads(1.7 * got, [h, w, b]), grads(1.7 * want, [h, w, b])):
        assert rel(g, r) <= TOL
    assert rel(got, torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), y.clamp(min=0),
                                                      reduction="sum")) > 1e-3  # ignored rows matter


def test_linear_cross_entropy_with_no_valid_label_is_zero_with_zero_gradients():
    h = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    loss = T.linear_cross_entropy(h, w, torch.full((2, 5), -100), tiles=3)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0
    with pytest.raises(ValueError, match="must agree on every dim but the last"):
        T.linear_cross_entropy(h, w, torch.zeros(2, 4, dtype=torch.long))


# ---- tiled MLP --------------------------------------------------------------------------------


def mlp(E: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(E, 40), torch.nn.GELU(), torch.nn.Linear(40, E))


@pytest.mark.parametrize("tiles", [1, 3, 13, 20])
def test_tiled_mlp_equals_the_untiled_module_and_sums_each_gradient_once(tiles):
    m = mlp()
    x = torch.randn(2, 13, 16, requires_grad=True)
    params = [x, *m.parameters()]
    want = grads((m(x) ** 2).sum(), params)
    arrivals = {id(p): 0 for p in m.parameters()}  # what DDP's hooks would see
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: arrivals.__setitem__(id(p), arrivals[id(p)] + 1))
    out = T.tiled_mlp(m, x, tiles, dim=1)
    (out**2).sum().backward()
    for got, r in zip([x.grad, *(p.grad for p in m.parameters())], want):
        assert rel(got, r) <= TOL
    assert set(arrivals.values()) == {1}


def test_tiled_mlp_recomputes_each_tile_with_the_forwards_dropout():
    """Backward recomputes the tiles from the forward's RNG state: the gradients are those of
    the tiles computed with their graphs kept (the same seed, the same dropout masks)."""
    m = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Dropout(0.5), torch.nn.Linear(40, 16)).train()
    x = torch.randn(2, 13, 16, requires_grad=True)
    torch.manual_seed(3)
    want_out = torch.cat([m(x[:, a:b]) for a, b in T._tile_bounds(13, 3)], 1)
    want = grads((want_out**2).sum(), [x, *m.parameters()])
    torch.manual_seed(3)
    out = T.tiled_mlp(m, x, 3, dim=1)
    assert torch.equal(out, want_out)
    for g, r in zip(grads((out**2).sum(), [x, *m.parameters()]), want):
        assert rel(g, r) <= TOL


def test_tiled_mlp_gives_parameter_gradients_when_x_needs_none():
    m = mlp()
    x = torch.randn(2, 13, 16)
    want = grads((m(x) ** 2).sum(), list(m.parameters()))
    for g, r in zip(grads((T.tiled_mlp(m, x, 4, dim=1) ** 2).sum(), list(m.parameters())), want):
        assert rel(g, r) <= TOL


def test_tiled_mlp_refuses_a_module_that_returns_a_tuple_or_hides_its_parameters():
    with pytest.raises(TypeError, match="only a module that returns one tensor"):
        T.tiled_mlp(lambda x: (x, x), torch.randn(1, 4, 2), 2, dim=1, params=[])
    with torch.no_grad(), pytest.raises(TypeError, match="only a module that returns one tensor"):
        T.tiled_mlp(lambda x: (x, x), torch.randn(1, 4, 2), 2, dim=1)
    m = mlp()
    with pytest.raises(ValueError, match="pass params="):  # a closure's parameters would get no gradient
        T.tiled_mlp(lambda x: m(x), torch.randn(1, 4, 16), 2, dim=1)


# ---- checkpoint and offload -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_checkpointed_layers_give_the_same_gradients_bit_for_bit(mode):
    m = mlp()
    drop = torch.nn.Dropout(0.3)  # the recompute must draw the same dropout mask

    def layer(x):
        return drop(m(x)) + x

    x = torch.randn(3, 5, 16, requires_grad=True)
    torch.manual_seed(5)
    want = grads((layer(layer(x)) ** 2).sum(), [x, *m.parameters()])
    torch.manual_seed(5)
    with T.offload_scope():
        y = T.checkpoint(layer, T.checkpoint(layer, x, mode=mode, params=list(m.parameters())),
                         mode=mode, params=list(m.parameters()))
    assert T.live_host_bytes() == (2 * x.numel() * 4 if mode == "offload" else 0)  # each layer's input, on the host
    got = grads((y**2).sum(), [x, *m.parameters()])
    for g, r in zip(got, want):
        assert torch.equal(g, r)
    del y
    gc.collect()
    assert T.live_host_bytes() == 0


def test_a_failure_mid_backward_leaks_no_offloaded_buffer():
    m = mlp()
    calls = {"n": 0}

    def layer(x):
        calls["n"] += 1
        if calls["n"] == 4:  # forward runs 3 layers; the first recompute (the last layer's) fails
            raise RuntimeError("a layer failed in backward")
        return m(x)

    before = T.live_host_bytes()
    x = torch.randn(2, 9, 16, requires_grad=True)
    with T.offload_scope():
        y = x
        for _ in range(3):
            y = T.checkpoint(layer, y, mode="offload", params=list(m.parameters()))
    assert T.live_host_bytes() > before
    with pytest.raises(RuntimeError, match="a layer failed in backward"):
        y.sum().backward()
    del y
    gc.collect()
    assert T.live_host_bytes() == before


def test_a_keyword_tensor_that_needs_a_gradient_is_refused():
    m = mlp()
    bias = torch.zeros(16, requires_grad=True)
    with pytest.raises(ValueError, match="keyword argument 'bias' needs a gradient"):
        T.checkpoint(lambda x, bias: m(x) + bias, torch.randn(1, 2, 16, requires_grad=True), bias=bias)
    with pytest.raises(ValueError, match="positional argument 2 needs a gradient"):
        T.checkpoint(lambda x, bias: m(x) + bias, torch.randn(1, 2, 16, requires_grad=True), bias)


def test_positional_arguments_follow_the_first_input():
    """checkpoint(f, x, a) runs f(x, a), as transformers' layers are called (a vision encoder
    layer takes its mask positionally after the hidden states): it ran f(a, x)."""
    m = mlp()
    x = torch.randn(1, 3, 16, requires_grad=True)
    scale = torch.full((16,), 0.5)
    want = m(x) * scale
    for mode in ("recompute", "offload"):
        got = T.checkpoint(lambda y, s: m(y) * s, x, scale, mode=mode, params=list(m.parameters()))
        assert torch.equal(got, want)
        got.sum().backward()


def test_a_module_layer_checkpoints_its_own_parameters():
    m = mlp()
    x = torch.randn(1, 3, 16, requires_grad=True)
    T.checkpoint(m, x).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


# ---- Hugging Face models with every feature ---------------------------------------------------


def long_step(model, batch, group):
    sb = uhf.shard_batch(batch, group)
    out = model(input_ids=sb["input_ids"], attention_mask=sb.get("attention_mask"), position_ids=sb["position_ids"],
                ulysses_seq_lens=sb["seq_lens"], ulysses_shift_labels=sb["shift_labels"])
    assert out.logits is None
    loss, global_loss = uhf.token_mean(out.loss, sb["shift_labels"], group)
    loss.backward()
    uhf.all_reduce_gradients(model, group)
    return global_loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def count_calls(model):
    """Counts each MLP tile's run (by its down_proj) and each decoder layer's run (by its
    attention: a recompute calls the layer's forward, not the hooks of its __call__)."""
    counts = {"mlp": 0, "layer": 0}

    def counter(key):
        return lambda *_: counts.__setitem__(key, counts[key] + 1)

    for layer in uhf._layers(model):
        layer.self_attn.register_forward_pre_hook(counter("layer"))
        layer.mlp.down_proj.register_forward_pre_hook(counter("mlp"))
    return counts


@pytest.mark.parametrize("name,kind,P,checkpoint", [
    ("llama", "padded", 1, "offload"), ("llama", "padded", 2, "offload"), ("llama", "packed", 3, "recompute"),
    ("qwen3", "padded", 2, "offload"), ("qwen3", "packed", 2, None), ("gemma2", "padded", 2, "offload"),
])
def test_hf_models_with_every_feature_equal_the_unsharded_model(name, kind, P, checkpoint):
    base = make_model(name)
    batch = make_batch(kind)  # S = 13: shards of 13, 7/6 or 5/4/4 rows
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base).train() for _ in range(P)]
    tile = 2

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group, tiled_mlp=True, tiled_loss=True, checkpoint=checkpoint,
                                      mlp_tile_tokens=tile, loss_tile_bytes=4 * 61 * 3)
        counts = count_calls(model)
        got = long_step(model, batch, group)
        return got, counts

    layers = len(uhf._layers(base))
    tiles = T.tile_count(-(-13 // P), tile)  # from the largest shard: the same on every rank
    for got, counts in run_ranks(P, body):
        assert_matches(got, want)
        runs = 2 if checkpoint else 1  # a checkpointed layer runs again in backward
        assert counts["layer"] == runs * layers
        assert counts["mlp"] == (runs + 1) * layers * tiles  # each tile recomputes once more in backward


def test_the_trainer_checkpointing_runs_through_ulysses_checkpoint():
    """A Trainer's gradient_checkpointing turns on transformers' checkpoint; under tiled_mlp the
    forward switches it to ulysses.tiled.checkpoint (its recompute cuts the tiles alike)."""
    base = make_model("llama")
    batch = make_batch("padded")
    want = reference(copy.deepcopy(base), batch)

    def body(rank, group):
        model = uhf.sequence_parallel(copy.deepcopy(base).train(), group, tiled_mlp=True, tiled_loss=True,
                                      mlp_tile_tokens=2)
        model.activation_checkpointing_enable()  # what a Trainer's gradient_checkpointing does
        got = long_step(model, batch, group)
        funcs = {type(layer._gradient_checkpointing_func).__name__ for layer in uhf._layers(model)}
        return got, funcs, [layer._gradient_checkpointing_func.func for layer in uhf._layers(model)]

    for got, funcs, used in run_ranks(2, body):
        assert_matches(got, want)
        assert all(f is T.checkpoint for f in used), funcs


def test_a_deep_copy_of_a_long_sequence_model_runs_itself():
    base = make_model("llama")

    def body(rank, group):
        model = uhf.sequence_parallel(copy.deepcopy(base).train(), group, tiled_mlp=True, tiled_loss=True)
        twin = copy.deepcopy(model)
        assert twin.forward.__self__ is twin and twin.model.layers[0].mlp.forward.__self__ is twin.model.layers[0].mlp
        sb = uhf.shard_batch(make_batch("plain"), group)
        twin(input_ids=sb["input_ids"], position_ids=sb["position_ids"],
             ulysses_shift_labels=sb["shift_labels"]).loss.backward()
        assert all(p.grad is None for p in model.parameters())  # the copy's gradients are its own
        assert all(p.grad is not None for p in twin.parameters())

    run_ranks(2, body)


@pytest.mark.parametrize("bad", ["label", "index"])
def test_one_ranks_bad_labels_fail_every_rank_alike(bad):
    """Rank 1's labels hold a token id outside the vocabulary (or the trainer's ignore_index
    differs there): every rank raises the same error from the forward, none waits for a
    timeout. The collectives that follow (token_mean's round) never start."""
    base = make_model("llama")
    vocab = base.config.vocab_size

    def body(rank, group):
        model = uhf.sequence_parallel(copy.deepcopy(base).train(), group, tiled_loss=True)
        sb = uhf.shard_batch(make_batch("plain"), group)
        labels = sb["shift_labels"].clone()
        ignore = -100
        if rank == 1 and bad == "label":
            labels[0, 0] = vocab + 5
        if rank == 1 and bad == "index":
            labels[0, 0], ignore = -1, -7  # -1 is then a label, and outside [0, V)
        out = model(input_ids=sb["input_ids"], position_ids=sb["position_ids"], ulysses_seq_lens=sb["seq_lens"],
                    ulysses_shift_labels=labels, ulysses_ignore_index=ignore)
        uhf.token_mean(out.loss, labels, group, ignore_index=ignore)

    errors = run_ranks_errors(2, body, timeout_s=60)
    assert len(set(errors)) == 1 and f"labels must be in [0, {vocab})" in errors[0], errors
    assert "rank 1" in errors[0], errors


def test_token_mean_is_the_global_mean_and_one_rank_failing_fails_all():
    def body(rank, group):
        labels = torch.tensor([[1, -100, 2]]) if rank == 0 else torch.tensor([[-100, -100]])
        token_sum = torch.tensor(3.0 + rank, requires_grad=True)
        loss, mean = uhf.token_mean(token_sum, labels, group)
        loss.backward()
        return mean.item(), token_sum.grad.item()

    assert run_ranks(2, body) == [(3.5, 0.5), (3.5, 0.5)]  # (3 + 4) / 2 targets

    def failing(rank, group):
        token_sum = torch.tensor(1.0) if rank == 0 else torch.ones(2)  # rank 1's is not a 0-d sum
        uhf.token_mean(token_sum, torch.tensor([[1]]), group)

    errors = run_ranks_errors(2, failing, timeout_s=60)
    assert len(set(errors)) == 1 and "token_sum must be a 0-d tensor" in errors[0], errors


def test_the_long_sequence_options_are_checked():
    model = make_model("llama")
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        uhf.sequence_parallel(model, checkpoint="disk")
    with pytest.raises(ValueError, match="must be >= 1"):
        uhf.sequence_parallel(model, mlp_tile_tokens=0)


def test_shift_labels_without_tiled_loss_are_refused():
    base = make_model("llama")

    def body(rank, group):
        model = uhf.sequence_parallel(copy.deepcopy(base), group)
        sb = uhf.shard_batch(make_batch("plain"), group)
        model(input_ids=sb["input_ids"], position_ids=sb["position_ids"], ulysses_shift_labels=sb["shift_labels"])

    with pytest.raises(AssertionError, match="ulysses_shift_labels needs sequence_parallel"):
        run_ranks(2, body)
