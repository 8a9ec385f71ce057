"""Hugging Face models (random init from configs) with ulysses.hf on thread ranks: loss and every
parameter gradient equal the unsharded model's (transformers' own eager attention and loss)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    StableLmConfig,
)

import ulysses.hf as uhf
from conftest import run_ranks, run_ranks_errors

S, B, VOCAB = 13, 2, 61  # S not divisible by 2 or 3
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              attention_dropout=0.0, use_cache=False, max_position_embeddings=64)
CONFIGS = {
    "llama": lambda: LlamaConfig(num_attention_heads=8, num_key_value_heads=2, **COMMON),
    "qwen2": lambda: Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "qwen3": lambda: Qwen3Config(num_attention_heads=4, num_key_value_heads=1, head_dim=8, **COMMON),
    "mistral": lambda: MistralConfig(num_attention_heads=8, num_key_value_heads=2, sliding_window=None, **COMMON),
    # Sliding windows shorter than S = 13: every layer (Mistral), or the second of two (Qwen2).
    "mistral_window": lambda: MistralConfig(num_attention_heads=8, num_key_value_heads=2, sliding_window=4, **COMMON),
    "qwen2_window": lambda: Qwen2Config(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=5, max_window_layers=1, **COMMON),
    # Logit softcap 0.5 on scores made large enough to meet it (initializer_range 0.3), a sliding
    # window of 5 on the first of two layers, and the final logit softcap (the model's own).
    "gemma2": lambda: Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                                   attn_logit_softcapping=0.5, sliding_window=5, initializer_range=0.3,
                                   **COMMON),
    # Value heads narrower than query/key heads (Dv 6, D 8 + 4 rotary), dense layers (MLA, no MoE).
    "deepseek_v3": lambda: DeepseekV3Config(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                                            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                            first_k_dense_replace=2, **COMMON),
    # Attention sinks (one learnable logit per head, `sinks`), sliding and full layers, MoE.
    "gpt_oss": lambda: GptOssConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5,
                                    num_local_experts=2, num_experts_per_tok=1, **COMMON),
    # Dispatches through the attention interface without declaring it (is_backend_compatible False).
    "stablelm": lambda: StableLmConfig(num_attention_heads=4, num_key_value_heads=2, **COMMON),
}


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").float()
    with torch.no_grad():  # Sinks large enough to matter (gpt-oss initialises them near 0).
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)
    return model


def make_batch(kind: str, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    batch = {"input_ids": ids}
    if kind == "padded":  # left padding on row 0 (keys to mask), right padding on row 1
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, :5] = 0
        mask[1, S - 4:] = 0
        batch["attention_mask"] = mask
        labels = ids.masked_fill(mask == 0, -100)  # no padding target, and no padding input:
        labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)  # (a pad predicts nothing)
        batch["labels"] = labels
    elif kind == "packed":  # three documents per row, positions restarting at 0
        batch["position_ids"] = torch.cat([torch.arange(5), torch.arange(4), torch.arange(4)]).expand(B, S)
    return batch


def reference(model, batch):
    """Loss and gradients of the unsharded model, by transformers' own attention and loss."""
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"), labels=batch.get("labels", batch["input_ids"]))
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_by_document(model, batch):
    """reference() for a packed batch, one document at a time: for models whose eager attention
    ignores packing (gpt-oss builds no document mask from position ids), the logits of each
    document alone, concatenated, under the same shifted loss."""
    model.zero_grad()
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [S]
    ids = batch["input_ids"]
    logits = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(starts, starts[1:])], 1)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def sharded_step(model, batch, group, give_seq_lens=True, give_positions=True):
    sb = uhf.shard_batch(batch, group)
    extra = {"ulysses_seq_lens": sb["seq_lens"]} if give_seq_lens else {}
    if give_positions:
        extra["position_ids"] = sb["position_ids"]
    out = model(input_ids=sb["input_ids"], attention_mask=sb.get("attention_mask"), **extra)
    loss, global_loss = uhf.sequence_parallel_loss(out.logits, sb["shift_labels"], group)
    loss.backward()
    uhf.all_reduce_gradients(model, group)
    return global_loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_matches(got, want):
    loss, grads = got
    ref_loss, ref_grads = want
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    for name, g in ref_grads.items():
        err = (grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err <= 1e-5, (name, err.item())


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "stablelm", "mistral_window", "qwen2_window",
                                  "gemma2", "deepseek_v3", "gpt_oss"])
def test_loss_and_every_gradient_equal_the_unsharded_model(name, kind, P):
    base = make_model(name)
    batch = make_batch(kind)
    by_document = kind == "packed" and name == "gpt_oss"  # its eager attention ignores packing
    want = (reference_by_document if by_document else reference)(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(P)]

    def body(rank, group):
        uhf.sequence_parallel(models[rank], group)
        return sharded_step(models[rank], batch, group)

    for got in run_ranks(P, body):
        assert_matches(got, want)


@pytest.mark.parametrize("name,chunks,recompute", [
    ("gemma2", 2, False), ("gpt_oss", 2, False), ("deepseek_v3", 2, False), ("llama", 2, False),
    ("deepseek_v3", "auto", False),  # (4 kv heads over 2 ranks: 2)
    ("gpt_oss", 2, True), ("llama", 1, True)])
def test_attention_in_head_chunks_trains_the_same_model(name, chunks, recompute):
    # sequence_parallel(head_chunks=k): every layer's attention in k chunks of heads, with the
    # model's window, softcap, sinks or narrow value heads, padded rows; loss and every gradient.
    # recompute_chunks: each chunk runs again in backward (gpt-oss's learnable sinks among them).
    base = make_model(name)
    batch = make_batch("padded")
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(rank, group):
        uhf.sequence_parallel(models[rank], group, head_chunks=chunks, recompute_chunks=recompute)
        return sharded_step(models[rank], batch, group)

    for got in run_ranks(2, body):
        assert_matches(got, want)
    with pytest.raises(ValueError, match="head_chunks must be an int >= 1 or .auto."):
        uhf.sequence_parallel(make_model(name), head_chunks=0)


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_default_position_ids_add_no_document_rule(kind):
    """transformers passes position ids to every layer; 0..S-1 on every row splits nothing, so
    local attention runs without them (no document mask on SDPA), exact all the same."""
    import ulysses

    seen = []

    def local(q, k, v, kv_map, mask, positions, causal, scale):
        seen.append(positions is not None)
        return ulysses.local_attention(q, k, v, kv_map, mask, positions, causal, scale, kernel="math")

    base = make_model("llama")
    batch = make_batch(kind)
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(rank, group):
        return sharded_step(uhf.sequence_parallel(models[rank], group, local=local), batch, group)

    for got in run_ranks(2, body):
        assert_matches(got, want)
    # Two ranks x two layers; packed rows keep their documents.
    assert seen == [kind == "packed"] * 4, seen


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("kind", ["plain", "padded"])
def test_a_forward_without_position_ids_numbers_tokens_globally(kind, rows):
    """Without position ids transformers numbers a shard's tokens 0..S_r-1: at B = 1 that used to
    pass (RoPE on local positions, every shard a document of its own: loss 4.5490 against 4.5578
    at P = 2). The forward of sequence_parallel gives this shard's part of 0..S-1 instead."""
    base = make_model("llama")
    batch = {key: t[:rows] for key, t in make_batch(kind).items()}
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(rank, group):
        return sharded_step(uhf.sequence_parallel(models[rank], group), batch, group, give_positions=False)

    for got in run_ranks(2, body):
        assert_matches(got, want)


def test_the_implementation_outside_sequence_parallel_is_refused_on_every_rank():
    """A model built with attn_implementation="ulysses" but never passed to sequence_parallel has
    no agreed split to number its tokens by: each rank would attend within its own shard."""
    models = [AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation="ulysses") for _ in range(2)]
    ids = make_batch("plain")["input_ids"]

    def body(rank, group):
        models[rank](input_ids=ids[:, 7 * rank:7 * rank + 7])

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and "outside a forward of ulysses.hf.sequence_parallel" in errors[0], errors


def test_qwen3_mqa_kv_replicated_over_three_ranks():
    base = make_model("qwen3")
    batch = make_batch("padded")
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(3)]

    def body(rank, group):  # Without ulysses_seq_lens: the forward learns them (one collective).
        return sharded_step(uhf.sequence_parallel(models[rank], group), batch, group, False)

    for got in run_ranks(3, body):
        assert_matches(got, want)


def test_seq_lens_are_learned_once_per_forward_or_given():
    import ulysses

    base = make_model("llama")
    models = [copy.deepcopy(base) for _ in range(2)]
    batch = make_batch("padded")

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group)
        counts = []
        # The first step arms the group's agreement (Note [Reused agreement]); count the others.
        for given in (True, True, False):
            before = ulysses._C.collective_count(group)
            sharded_step(model, batch, group, given)
            counts.append(ulysses._C.collective_count(group) - before)
        return counts[1:]

    for with_lens, without in run_ranks(2, body):
        # Without them the model's forward learns the split once and passes it to every layer.
        assert without - with_lens == 1, (with_lens, without)


@pytest.mark.parametrize("kind", ["plain", "padded", "packed"])
def test_a_later_layer_issues_two_exchanges_only(kind):
    """The forward shares one StepContext across its layers: the padding mask, its rebuild and
    the position ids are gathered once, and the group's armed agreement serves every layer (Note
    [Reused agreement]), so each further layer adds the exchange to heads and the one back,
    whatever the batch holds."""
    import ulysses

    def make(layers):
        torch.manual_seed(0)
        config = LlamaConfig(num_attention_heads=8, num_key_value_heads=2, **{**COMMON, "num_hidden_layers": layers})
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()

    batch = make_batch(kind)
    models = {n: [make(n) for _ in range(2)] for n in (2, 3)}

    def body(rank, group):
        counts = {}
        for n, replicas in models.items():
            model = uhf.sequence_parallel(replicas[rank], group)
            sb = uhf.shard_batch(batch, group)
            for _ in range(2):  # The first forward arms the group's agreement: count the second.
                before = ulysses._C.collective_count(group)
                with torch.no_grad():
                    model(input_ids=sb["input_ids"], attention_mask=sb.get("attention_mask"),
                          position_ids=sb["position_ids"], ulysses_seq_lens=sb["seq_lens"])
                counts[n] = ulysses._C.collective_count(group) - before
        return counts[3] - counts[2]

    assert run_ranks(2, body) == [2, 2]


def test_two_models_with_different_head_counts_train_alternately():
    bases = {"llama": make_model("llama", 3), "qwen2": make_model("qwen2", 4)}
    batches = {"llama": make_batch("padded", 5), "qwen2": make_batch("packed", 6)}
    wants = {n: reference(copy.deepcopy(m), batches[n]) for n, m in bases.items()}
    per_rank = [{n: copy.deepcopy(m) for n, m in bases.items()} for _ in range(2)]

    def body(rank, group):
        models = {n: uhf.sequence_parallel(m, group) for n, m in per_rank[rank].items()}
        results = []
        for _ in range(2):  # alternate: each model keeps its own head counts
            for n in ("llama", "qwen2"):
                models[n].zero_grad()
                results.append((n, sharded_step(models[n], batches[n], group)))
        return results

    for results in run_ranks(2, body):
        for n, got in results:
            assert_matches(got, wants[n])


def test_query_sharded_4d_mask_given_to_the_model_is_rebuilt():
    # A custom additive 4-D mask (causal, and key 3 banned) passed straight to the model:
    # transformers hands it to attention as it is; each rank gives its query rows [B, 1, S_r, S].
    base = make_model("llama")
    ids = make_batch("plain")["input_ids"]
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    allowed[4:, 3] = False
    mask = torch.zeros(B, 1, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref = copy.deepcopy(base)
    out = ref(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    want = (out.loss.item(), {n: p.grad.clone() for n, p in ref.named_parameters()})
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group)
        sb = uhf.shard_batch({"input_ids": ids}, group)
        start = sum(sb["seq_lens"][:rank])
        local_mask = mask[:, :, start:start + sb["seq_lens"][rank]]
        logits = model(input_ids=sb["input_ids"], attention_mask=local_mask,
                       position_ids=sb["position_ids"]).logits
        loss, global_loss = uhf.sequence_parallel_loss(logits, sb["shift_labels"], group)
        loss.backward()
        uhf.all_reduce_gradients(model, group)
        return global_loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    for got in run_ranks(2, body):
        assert_matches(got, want)


def test_the_sliding_window_reaches_attention():
    # Guards the sweep above: with its window 4, Mistral's loss differs from the same weights
    # without one, so a window the attention ignored would fail there.
    base = make_model("mistral_window")
    full = copy.deepcopy(base)
    full.config.sliding_window = None
    batch = make_batch("padded")
    assert abs(reference(base, batch)[0] - reference(full, batch)[0]) > 1e-4


def test_the_attention_sinks_reach_attention():
    # Guards the gpt-oss rows of the sweep: its loss with the sinks at -inf (none) differs.
    base = make_model("gpt_oss")
    sinkless = copy.deepcopy(base)
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(-float("inf"))
    batch = make_batch("padded")
    assert abs(reference(base, batch)[0] - reference(sinkless, batch)[0]) > 1e-3


def test_the_logit_softcap_reaches_attention():
    # Guards the Gemma2 rows of the sweep: its loss without the attention softcap differs.
    base = make_model("gemma2")
    uncapped = copy.deepcopy(base)
    uncapped.config.attn_logit_softcapping = None
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    batch = make_batch("padded")
    assert abs(reference(base, batch)[0] - reference(uncapped, batch)[0]) > 1e-3


def test_example_trains_under_torchrun():
    from conftest import run_example

    r = run_example("hf_sequence_parallel.py", 2, "--seq-len", "31", "--steps", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "over 2 ranks (tokens per rank: [16, 15])" in r.stdout and "step 3/3 loss" in r.stdout, r.stdout


def falcon_config():
    from transformers import FalconConfig

    return FalconConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=4)


FALCON_REFUSED = ("ulysses.hf: FalconForCausalLM does not run its attention through transformers' "
                  "attention interface")


def test_a_model_that_bypasses_the_attention_interface_is_refused_on_every_rank():
    # Falcon picks its attention classes by name: switched to "ulysses" it used to keep its own
    # attention, each rank attending within its shard only (loss error 2.6e-4 at P = 2).
    with pytest.raises(ValueError, match=FALCON_REFUSED):
        AutoModelForCausalLM.from_config(falcon_config(), attn_implementation="ulysses")

    def body(rank, group):
        uhf.sequence_parallel(AutoModelForCausalLM.from_config(falcon_config()), group)

    errors = run_ranks_errors(2, body)
    assert all(FALCON_REFUSED in e for e in errors), errors
    assert errors[0] == errors[1]


def test_from_config_takes_the_ulysses_implementation():
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation="ulysses")
    assert model.config._attn_implementation == "ulysses"
    # StableLM dispatches through the interface without declaring it: accepted.
    model = AutoModelForCausalLM.from_config(CONFIGS["stablelm"](), attn_implementation="ulysses")
    assert model.config._attn_implementation == "ulysses"


def llama4_config():
    from transformers import Llama4TextConfig

    return Llama4TextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, intermediate_size_mlp=32,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                            num_local_experts=2, attention_chunk_size=4)


def test_chunked_attention_is_refused_on_every_rank():
    # Llama 4's chunked layers exist only in the masks transformers builds, which the "ulysses"
    # implementation does not: accepted, each rank would attend across chunks.
    refused = "ulysses.hf: Llama4ForCausalLM has chunked-attention layers"
    with pytest.raises(ValueError, match=refused):
        AutoModelForCausalLM.from_config(llama4_config(), attn_implementation="ulysses")

    def body(rank, group):
        uhf.sequence_parallel(AutoModelForCausalLM.from_config(llama4_config()), group)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and refused in errors[0], errors
    # Without chunks (attention_chunk_size None) the same model is accepted.
    cfg = llama4_config()
    cfg.attention_chunk_size = None
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    AutoModelForCausalLM.from_config(cfg, attn_implementation="ulysses")


# Models whose decoder layers mix tokens outside attention by layers ulysses.hybrid does not run
# (Mamba-1, Falcon-H1's parallel hybrid, Kimi's delta attention): a rank holding one shard
# cannot compute those layers alone. (The families it runs: test_hybrid.py.)
def jamba_config():
    from transformers import JambaConfig

    return JambaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                       mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2)


def kimi_linear_config():
    from transformers import KimiLinearConfig

    return KimiLinearConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=4, pad_token_id=0)


def falcon_h1_config():
    from transformers import FalconH1Config

    return FalconH1Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=8,
                          mamba_d_ssm=32, mamba_d_state=8, mamba_n_groups=1)


HYBRIDS = {"JambaForCausalLM": (jamba_config, "'linear_attention', 'mamba'"),
           "KimiLinearForCausalLM": (kimi_linear_config, "'linear_attention'"),
           "FalconH1ForCausalLM": (falcon_h1_config, "'hybrid'")}


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_a_model_that_mixes_tokens_outside_attention_is_refused_on_every_rank(name):
    config, layers = HYBRIDS[name]
    refused = f"ulysses.hf: {name} mixes tokens outside attention (its {layers} layers)"
    with pytest.raises(ValueError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        AutoModelForCausalLM.from_config(config(), attn_implementation="ulysses")

    def body(rank, group):
        uhf.sequence_parallel(AutoModelForCausalLM.from_config(config()), group)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and refused in errors[0], errors


def test_a_token_mixer_the_library_does_not_know_is_found_in_the_modules():
    # LFM2 runs exactly (its short convolutions by class); a layer of a class the library does
    # not know, even one derived from a known mixer, is refused by the module scan.
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    class CustomShortConv(Lfm2ShortConv):
        pass

    model = AutoModelForCausalLM.from_config(Lfm2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=2, full_attn_idxs=[1]))
    conv = model.model.layers[0].conv
    custom = CustomShortConv(model.config, 0)
    custom.load_state_dict(conv.state_dict())
    model.model.layers[0].conv = custom
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM mixes tokens outside attention \(CustomShortConv in its "
                                         r"decoder layers\)"):
        uhf.sequence_parallel(model, "")


def test_every_hybrid_family_of_transformers_is_refused():
    """Walks every config transformers registers: each family with layers that mix tokens
    outside attention (Mamba-style hybrids, linear attention, short convolutions, sparse
    attention the interface does not see) is refused; attention-only families are not."""
    import warnings

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    refused = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in CONFIG_MAPPING_NAMES:
            try:
                config = CONFIG_MAPPING[model_type]()
            except Exception:  # noqa: BLE001 - a config that needs arguments: not walked
                continue
            if uhf._layer_types(config) - uhf._ATTENTION_ONLY_LAYERS - {"chunked_attention"}:
                refused.add(model_type)
    hybrids = {"qwen3_next", "jamba", "bamba", "falcon_h1", "nemotron_h", "granitemoehybrid", "minimax", "zamba2",
               "mamba", "mamba2", "recurrent_gemma"}  # by layer type (those ulysses.hybrid runs are then let in)
    assert hybrids <= refused, hybrids - refused
    attention_only = {"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "gpt_oss", "phi3", "deepseek_v3"}
    assert not attention_only & refused, attention_only & refused


@pytest.mark.parametrize("name,kind", [("llama", "padded"), ("llama", "packed"), ("gemma2", "packed"),
                                       ("mistral_window", "padded"), ("gpt_oss", "padded")])
def test_flex_local_attention_gives_the_default_kernels_forward(name, kind):
    """sequence_parallel(..., local="flex"): every layer on FlexAttention (forward only off CUDA),
    padding, packed documents, sliding windows, Gemma2's softcap and gpt-oss's sinks included,
    at P = 2."""
    import warnings

    base = make_model(name)
    batch = make_batch(kind)
    replicas = {local: [copy.deepcopy(base) for _ in range(2)] for local in ("auto", "flex")}

    def body(rank, group):
        logits = {}
        for local, models in replicas.items():
            model = uhf.sequence_parallel(models[rank], group, local=local)
            sb = uhf.shard_batch(batch, group)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # flex's "without torch.compile" off CUDA
                logits[local] = model(input_ids=sb["input_ids"], attention_mask=sb.get("attention_mask"),
                                      position_ids=sb["position_ids"], ulysses_seq_lens=sb["seq_lens"]).logits
        return ((logits["flex"] - logits["auto"]).abs().max() / logits["auto"].abs().max()).item()

    errors = run_ranks(2, body)
    assert max(errors) <= 1e-5, errors


def test_an_unknown_local_kernel_is_refused():
    with pytest.raises(ValueError, match="local must be one of .* or a callable"):
        uhf.sequence_parallel(make_model("llama"), None, local="flexible")


@pytest.mark.parametrize("padded", [False, True])
def test_an_all_true_padding_mask_adds_no_rule(padded, monkeypatch):
    """Trainer batches carry an attention_mask of ones: once gathered it is dropped (alike on every
    rank, once per step), so on a GPU each layer runs SDPA with no mask, not FlexAttention; a
    mask that pads does not. The rule's device is forced to CUDA here; exact either way."""
    import threading
    import warnings

    import ulysses.ops as ops

    base = make_model("llama")
    batch = make_batch("padded")
    if not padded:
        batch = {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["attention_mask"])}
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(2)]
    choose, chosen, lock = ops.local_kernel, [], threading.Lock()

    def recorded(*args, **kwargs):
        kernel = choose(*args, **kwargs)
        with lock:
            chosen.append(kernel)
        return kernel

    monkeypatch.setattr(ops, "_rule_device", lambda q: "cuda")
    monkeypatch.setattr(ops, "local_kernel", recorded)

    def body(rank, group):  # Forward only: torch's FlexAttention has no CPU backward.
        model = uhf.sequence_parallel(models[rank], group)
        sb = uhf.shard_batch(batch, group)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex's "called without torch.compile" off CUDA
            out = model(input_ids=sb["input_ids"], attention_mask=sb["attention_mask"],
                        position_ids=sb["position_ids"], ulysses_seq_lens=sb["seq_lens"])
        return uhf.sequence_parallel_loss(out.logits, sb["shift_labels"], group)[1].item()

    for loss in run_ranks(2, body):
        assert abs(loss - want[0]) <= 1e-5 * abs(want[0]), (loss, want[0])
    # Two ranks x two layers ask the rule twice: before their exchange, where the position ids
    # count as documents (flex: Python runs the layer), and after it, where the gathered ids split
    # nothing and the mask is the padding's or none.
    assert sorted(chosen) == sorted(["flex"] * 4 + ["flex" if padded else "sdpa"] * 4), chosen


VERIFIED = ["llama", "qwen3_moe", "gemma2", "gpt_oss"]


def make_verified(name: str) -> torch.nn.Module:
    if name != "qwen3_moe":
        return make_model(name)
    from transformers import Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, **COMMON)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


@pytest.mark.parametrize("name", VERIFIED)
def test_verify_passes_on_models_that_are_exact(name):
    """ulysses.hf.verify: one call, the model against itself unsharded (Llama; Qwen3 MoE; Gemma2's
    softcap and window; gpt-oss's sinks), at P = 2 on a padded batch."""
    base = make_verified(name)
    batch = make_batch("padded")
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group)
        result = uhf.verify(model, batch, group, tolerance=1e-5)
        assert all(p.grad is None for p in model.parameters())  # nothing reached .grad
        return result.loss_error, result.worst

    results = run_ranks(2, body)
    assert results[0] == results[1], results
    assert results[0][0] <= 1e-5 and results[0][1][1] <= 1e-5, results


def test_verify_names_the_parameter_a_broken_reduction_left_out():
    """A reduction that skips one parameter (the mistake SP code makes most: a gradient not summed
    over the group) is caught, named, and raised alike on every rank above the tolerance."""
    base = make_model("llama")
    batch = make_batch("packed")
    models = [copy.deepcopy(base) for _ in range(2)]
    skipped = "model.layers.1.self_attn.k_proj.weight"

    def body(rank, group):
        import ulysses

        model = uhf.sequence_parallel(models[rank], group)
        names = [n for n, p in model.named_parameters() if p.requires_grad]

        def broken(grads, group_name):
            summed = [g for n, g in zip(names, grads) if n != skipped]
            torch.ops.ulysses.all_reduce_gradients(summed, group_name, ulysses.groups.group_options(None))

        result = uhf.verify(model, batch, group, reduce_gradients=broken)
        with pytest.raises(ValueError, match=f"worst overall: {skipped}"):
            uhf.verify(model, batch, group, reduce_gradients=broken, tolerance=1e-5)
        return result.worst, result.gradient_errors

    for (worst, error), errors in run_ranks(2, body):
        assert worst == skipped and error > 1e-2, (worst, error)
        assert max(e for n, e in errors.items() if n != skipped) <= 1e-5


# --- whole-sequence log-probabilities (TRL's fused LM head: DPO, GRPO) and unsharded() ---

def fused_models(name: str, world: int):
    """The model with TRL's fused LM head (the unsharded reference) and, per rank, a copy made
    sequence-parallel the way WholeSequenceLogProbs does: (reference, [(model, trl's forward)])."""
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="TRL's fused LM head needs trl (pip install trl)")
    base = make_model(name)
    reference_model = copy.deepcopy(base)
    trl_utils.add_fused_lm_head(reference_model, outputs=("log_probs", "entropy"))
    copies = []
    for _ in range(world):
        model = copy.deepcopy(base)
        trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        copies.append((model, model.__dict__["forward"]))
    return reference_model, copies


def scored(out, weights):
    return (out.log_probs * weights).sum() + 0.1 * out.entropy.sum()


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_whole_sequence_log_probs_equal_the_unsharded_fused_head(name, P):
    """Per-token log-probabilities and entropies of whole sequences, each rank scoring its shard
    (hf.whole_sequence_fused_forward), equal TRL's fused head on the model unsharded, and the
    gradients averaged over the ranks (as DDP does) equal its gradients: padded rows (left and
    right), completion-only labels, S not divisible by P; Gemma2's softcaps too."""
    reference_model, copies = fused_models(name, P)
    batch = make_batch("padded")
    labels = batch["labels"].clone()
    labels[:, :6] = -100  # a prompt: only the completion is scored
    weights = torch.randn(B, S - 1, generator=torch.Generator().manual_seed(3))
    want = reference_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                           fused_lm_head=True)
    scored(want, weights).backward()

    def body(rank, group):
        model, fused = copies[rank]
        uhf.sequence_parallel(model, group)
        out = uhf.whole_sequence_fused_forward(model, fused, input_ids=batch["input_ids"],
                                               attention_mask=batch["attention_mask"], labels=labels)
        scored(out, weights).backward()
        return out.log_probs.detach(), out.entropy.detach(), {n: p.grad for n, p in model.named_parameters()}

    results = run_ranks(P, body)
    for log_probs, entropy, _ in results:
        torch.testing.assert_close(log_probs, want.log_probs.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy, want.entropy.detach(), rtol=1e-5, atol=1e-5)
    for n, p in reference_model.named_parameters():
        averaged = sum(r[2][n] for r in results) / P
        err = (averaged - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)
        assert err <= 1e-5, (n, err.item())


@pytest.mark.parametrize("other", ["longer", "more_rows", "other_tokens"])
def test_ranks_holding_other_sequences_fail_every_rank_alike(other):
    """Each rank of an SP group must hold the group's whole batch: a rank with a longer
    completion, more completions, or the same shape with other tokens (a shard of someone else's
    sequence would be a silent wrong) raises the same error on every rank, before any exchange."""
    _, copies = fused_models("llama", 2)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(2, VOCAB, (B, S), generator=gen)] * 2
    batches[1] = {"longer": torch.randint(2, VOCAB, (B, S + 2), generator=gen),
                  "more_rows": torch.randint(2, VOCAB, (B + 2, S), generator=gen),
                  "other_tokens": torch.randint(2, VOCAB, (B, S), generator=gen)}[other]

    def body(rank, group):
        model, fused = copies[rank]
        uhf.sequence_parallel(model, group)
        ids = batches[rank]
        uhf.whole_sequence_fused_forward(model, fused, input_ids=ids, labels=ids)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and "ulysses.hf: the ranks of a sequence-parallel group" in errors[0], errors
    assert ("rank(s) [1] hold other tokens" if other == "other_tokens" else "rank 1 has") in errors[0]


def test_generation_inside_unsharded_equals_the_plain_model():
    """hf.unsharded(model): transformers' generate (KV cache and all) on whole prompts gives the
    plain model's tokens, with no collective; on exit the model is sequence-parallel again and
    its training forward still equals the unsharded reference."""
    base = make_model("llama")
    prompt = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=True)
    want_tokens = copy.deepcopy(base).generate(prompt, **kwargs)
    batch = make_batch("packed")
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group)
        with uhf.unsharded(model):
            tokens = model.generate(prompt, **kwargs) if rank == 0 else None  # rank 1 takes no part
        assert model.config._attn_implementation == uhf.IMPLEMENTATION
        return tokens, sharded_step(model, batch, group)

    results = run_ranks(2, body)
    assert torch.equal(results[0][0], want_tokens)
    for _, got in results:
        assert_matches(got, want)
    with pytest.raises(ValueError, match="takes a model made sequence-parallel"):
        with uhf.unsharded(make_model("llama")):
            pass


def _paligemma_config():
    from transformers import PaliGemmaConfig

    return PaliGemmaConfig(text_config=dict(model_type="gemma", vocab_size=64, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8),
                           vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, image_size=28,
                                              patch_size=14, projection_dim=32), image_token_index=60)


@pytest.mark.parametrize("config", [_paligemma_config])
def test_a_vision_language_model_is_refused_alike_with_what_to_do(config):
    """A VLM that ulysses.vision does not run (PaliGemma: a bidirectional prefix) used to fail at
    its first forward with an agreement error about sequence lengths (the vision tower's attention
    taken over, its patches treated as a shard); it is refused by name before any collective, on
    every rank alike."""
    from transformers import AutoModelForImageTextToText

    with pytest.raises(ValueError, match=r"merges the outputs of an encoder \(vision_config\)"):
        AutoModelForImageTextToText.from_config(config(), attn_implementation="ulysses")

    def body(rank, group):
        uhf.sequence_parallel(AutoModelForImageTextToText.from_config(config()), group)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and "ForConditionalGeneration merges the outputs of an encoder" in errors[0], errors


def test_gradients_some_ranks_lack_are_summed_as_zeros():
    """A parameter with a gradient on some ranks only (an expert no token of this shard chose, a
    vision tower that encoded no frame here) used to give the ranks flat buffers of different
    sizes (Gloo aborted); it is summed as zeros where missing, and one no rank used stays None."""
    torch.manual_seed(0)
    base = torch.nn.ModuleDict({name: torch.nn.Linear(3, 3) for name in "abc"})
    models = [copy.deepcopy(base) for _ in range(2)]

    def forward(model, rank):  # rank 0 uses a and b, rank 1 only a; nobody uses c
        x = torch.full((1, 3), float(rank + 1))
        return model["b"](model["a"](x)) if rank == 0 else model["a"](x)

    def body(rank, group):
        forward(models[rank], rank).sum().backward()
        uhf.all_reduce_gradients(models[rank], group)
        return {n: None if p.grad is None else p.grad.clone() for n, p in models[rank].named_parameters()}

    for rank in range(2):
        forward(base, rank).sum().backward()
    for grads in run_ranks(2, body):
        assert grads["c.weight"] is None and grads["c.bias"] is None
        for name, p in base.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[name], p.grad)
