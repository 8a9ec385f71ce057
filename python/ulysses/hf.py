"""Hugging Face ``transformers`` models with Ulysses sequence parallelism.

Importing this module registers the attention implementation ``"ulysses"`` (and its mask
function) with ``transformers``, so a model built with
``AutoModelForCausalLM.from_config(cfg, attn_implementation="ulysses")`` (or switched with
:func:`sequence_parallel`) runs every attention through a :class:`ulysses.DistributedAttention`
owned by that attention module: head counts come from the module's own q and k (GQA, MQA and
uneven heads over the group work; two models with different head counts share a process).

Each rank runs the model on its sequence shard (:func:`shard_batch`), with *global* position
ids (RoPE and packed documents need them). Masks are honoured, not dropped:

- a 2-D padding mask ``[B, S_r]`` (this rank's columns) is gathered into a key mask ``[B, 1, 1, S]``;
- a 4-D mask given to the model (e.g. ``[B, 1, S_r, S]``, query rows sharded) is rebuilt by the
  mask rules of ``DistributedAttention``;
- packed sequences (position ids restarting at 0) attend within their document only.

:func:`sequence_parallel_loss` gives the exact global token mean over the group, and
:func:`all_reduce_gradients` sums gradients over the SP x DP ranks that share the loss.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import _C, hybrid, tiled, vision
from . import groups as G
from . import ops as O
from .attention import DistributedAttention, HeadChunks, LocalAttention, StepContext, check_head_chunks
from .training import (  # noqa: F401  (part of this module's API, as before)
    IGNORE_INDEX,
    all_reduce_gradients,
    sequence_parallel_loss,
    shard_batch,
    token_mean,
)

IMPLEMENTATION = "ulysses"
_log = logging.getLogger("ulysses.hf")


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """The mask function of the "ulysses" implementation: the 2-D padding mask as it is (the
    attention gathers it), never a locally built causal mask ([S_r, S_r] would be key-sharded).
    Unlike flash-attention's, it never drops an all-true mask here, where that would be a
    per-rank decision: the attention drops it once gathered, alike on every rank."""
    return attention_mask


def _attention_of(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  dense_mask: bool = False) -> DistributedAttention:
    """The module's attention; with ``dense_mask`` a second one, not causal, for calls whose mask
    stands for every rule (Gemma 3's image blocks: ``ulysses.vision.block_masks``)."""
    slot = "_ulysses_attention_dense" if dense_mask else "_ulysses_attention"
    attention = module.__dict__.get(slot)
    if attention is None:
        group = module.__dict__["_ulysses_group"]  # set by sequence_parallel()
        timeout = module.__dict__.get("_ulysses_timeout")
        # BSHD on transposed views: o comes back [B, S_r, Hq, D] contiguous, so the model's
        # reshape for o_proj is a view of it (a recomputed chunk's backward reads o; no copy
        # beside it lives until then).
        attention = DistributedAttention(group, q_heads=query.shape[1], kv_heads=key.shape[1],
                                         layout="BSHD", causal=not dense_mask and getattr(module, "is_causal", True),
                                         timeout=timeout, local=module.__dict__.get("_ulysses_local", "auto"),
                                         head_chunks=module.__dict__.get("_ulysses_head_chunks", 1),
                                         recompute_chunks=module.__dict__.get("_ulysses_recompute_chunks", False))
        object.__setattr__(module, slot, attention)  # state, not a submodule
    return attention


def ulysses_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None,
                              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """``transformers``' attention interface: q ``[B, Hq, S_r, D]``, k/v ``[B, Hkv, S_r, D]`` on
    this rank's shard -> ``([B, S_r, Hq, D], None)``."""
    if dropout and module.training:
        raise NotImplementedError("ulysses attention: attention dropout is not supported; set the "
                                  "model's attention_dropout to 0")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("ulysses attention: position_bias is not supported")
    if "_ulysses_group" not in module.__dict__:  # Every rank runs the same model: it raises alike.
        raise ValueError(f"ulysses.hf: {type(module).__name__} ran attn_implementation='ulysses' outside a "
                         "forward of ulysses.hf.sequence_parallel(model, group): call that first, so that "
                         "every layer attends over the agreed split with global position ids (without "
                         "it each rank would attend within its own shard)")
    dense = bool(kwargs.get("ulysses_dense_mask"))
    attention = _attention_of(module, query, key, dense)
    if is_causal is not None and bool(is_causal) != attention.causal:
        raise ValueError(f"ulysses attention: is_causal={is_causal} but the module's attention "
                         f"was built with causal={attention.causal}")
    group, timeout = attention.group_name, attention.wait
    seq_lens = kwargs.get("ulysses_seq_lens") or O.sequence_lengths(query, 2, group, timeout)
    step = None if torch.compiler.is_compiling() else kwargs.get("ulysses_step")
    mask = attention_mask
    if mask is not None and mask.dim() == 2:  # padding [B, S_r] -> key mask [B, 1, 1, S]
        def gather(padding=mask):
            keys = O.all_gather_sequence(padding.bool(), -1, seq_lens, group, timeout)[:, None, None, :]
            # A mask that excludes nothing is dropped, so the layer runs with no rule at all (flash
            # SDPA on a GPU; the Trainer's batches carry one). Every rank gathered the same keys, so
            # every rank drops it alike; one host read per step (the StepContext's). A traced call
            # keeps it.
            return None if not torch.compiler.is_compiling() and bool(keys.all()) else keys

        mask = gather() if step is None else step.once(mask, tuple(seq_lens), gather)
    attention.scale = scaling
    # transformers' sliding_window W: query i sees keys i - W < j <= i (its mask functions'
    # rule), the kernels' window. Set per call: a layer's kind (sliding or full) is fixed.
    attention.window = 0 if dense else int(kwargs.get("sliding_window") or 0)  # (a dense mask holds it)
    attention.softcap = float(kwargs.get("softcap") or 0.0)  # Gemma2's attn_logit_softcapping
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask=mask,
                    position_ids=kwargs.get("position_ids"), seq_lens=seq_lens, sinks=kwargs.get("s_aux"),
                    step=step)  # s_aux: gpt-oss's sinks
    return out, None


AttentionInterface.register(IMPLEMENTATION, ulysses_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, _padding_mask)


def _uses_attention_interface(model_class: type[PreTrainedModel]) -> bool:
    """Whether the model's attention dispatches through transformers' attention interface: its
    class says so, or its modeling module consults ALL_ATTENTION_FUNCTIONS (StableLM does without
    saying so; Falcon does neither, and picks its attention classes by name)."""
    if model_class.is_backend_compatible():
        return True
    module = sys.modules.get(model_class.__module__)
    return module is not None and "ALL_ATTENTION_FUNCTIONS" in vars(module)


def _refusal(model_class: type) -> str:
    return (f"ulysses.hf: {model_class.__name__} does not run its attention through transformers' "
            "attention interface (it picks its attention classes by name), so the 'ulysses' "
            "implementation cannot take it over and each rank would attend within its own shard "
            "only. Use a model that does (Llama, Qwen2/3, Mistral, Gemma, Phi3, ...), or put "
            "ulysses.DistributedAttention into its attention, or compile it with ulysses.autosp")


def _chunked_refusal(model_class: type) -> str:
    return (f"ulysses.hf: {model_class.__name__} has chunked-attention layers (Llama 4's "
            "attention_chunk_size), which transformers expresses only in masks that the 'ulysses' "
            "implementation does not build; each rank would attend across chunks. Not supported "
            "yet: set config.attention_chunk_size = None (full attention) or train it without "
            "sequence parallelism")


# Layer types (config.layer_types, or layers_block_type) whose only token mixing is attention
# that goes through the interface, or that mix no tokens at all. Any other type (linear
# attention, Mamba, short convolutions, hybrids, ...) mixes tokens outside attention.
_ATTENTION_ONLY_LAYERS = frozenset({"full_attention", "sliding_attention", "attention", "global", "local",
                                    "mlp", "moe", "dense"})


def _layer_types(config) -> set[str]:
    sources = [config]
    try:
        sources.append(config.get_text_config())
    except ValueError:  # Several text configs (an encoder-decoder): each sub-model checks its own.
        pass
    types: set[str] = set()
    for source in sources:
        for name in ("layer_types", "layers_block_type"):
            types.update(str(t) for t in (getattr(source, name, None) or ()))
    return types


def _mixing_refusal(model_class: type, what: str) -> str:
    return (f"ulysses.hf: {model_class.__name__} mixes tokens outside attention ({what}): a rank holding "
            "one shard of the sequence cannot compute those layers alone, so sequence parallelism would "
            "train it wrong without an error. Not supported: train it without sequence parallelism, or "
            "use a model whose decoder layers mix tokens only in attention (Llama, Qwen2/3, Mistral, "
            "Gemma, Phi3, ...)")


def _token_mixers(model: torch.nn.Module) -> list[str]:
    """The classes of modules inside decoder layers that mix tokens outside attention: a
    convolution wider than one position (Mamba's, LFM2's short convolution, gated delta nets')."""
    found = []
    for layer in _layers(model):
        for name, module in layer.named_modules():
            convolution = isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d))
            if convolution and any(k > 1 for k in module.kernel_size):
                owner = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
                if type(owner).__name__ not in hybrid.MIXERS:  # those run exactly (ulysses.hybrid)
                    found.append(type(owner).__name__)
    return sorted(set(found))


# Sub-configs of encoders whose outputs are merged into the text sequence (vision, audio).
_ENCODER_CONFIGS = ("vision_config", "audio_config", "vision_tower_config")


def _encoder_refusal(model_class: type, which: str) -> str:
    return (f"ulysses.hf: {model_class.__name__} merges the outputs of an encoder ({which}) into its text "
            "sequence. Under sequence parallelism that encoder's own attention would be taken over and "
            "its inputs treated as sequence shards, and the merge and multimodal positions (mrope, "
            "bidirectional image blocks) would be made per shard: not exact, so not supported yet. Train it "
            "without sequence parallelism, or its language model alone on text")


def _refusal_of(module: PreTrainedModel) -> str | None:
    """Why ``module`` cannot run the "ulysses" implementation exactly, or None."""
    if not _uses_attention_interface(type(module)):
        return _refusal(type(module))
    which = [name for name in _ENCODER_CONFIGS if getattr(module.config, name, None) is not None]
    if which and not vision.is_vision_language(module):
        return _encoder_refusal(type(module), ", ".join(which))
    types = _layer_types(module.config)
    if "chunked_attention" in types:
        return _chunked_refusal(type(module))
    served = hybrid.layer_types_served(type(module))
    if mixing := sorted(types - _ATTENTION_ONLY_LAYERS - served - {"chunked_attention"}):
        return _mixing_refusal(type(module), f"its {', '.join(repr(t) for t in mixing)} layers")
    return None


def _model_refusal(model: torch.nn.Module) -> str | None:
    """Why a built ``model`` (or any sub-model) cannot run the "ulysses" implementation exactly:
    its classes and configs (:func:`_refusal_of`), then its modules (a token mixer a config does
    not name)."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and (why := _refusal_of(module)) is not None:
            return why
    if mixers := _token_mixers(model):
        return _mixing_refusal(type(model), f"{', '.join(mixers)} in its decoder layers")
    return None


def _check_backend(model: torch.nn.Module) -> None:
    """Raises for a model (or any sub-model) that would silently keep its own attention, attend
    by rules the implementation does not see, or mix tokens outside attention. The decision
    reads only the model's classes, configs and modules, which every rank holds alike, so every
    rank raises the same error before any collective."""
    if (why := _model_refusal(model)) is not None:
        raise ValueError(why)


def _refuse_incompatible(get_correct_attn_implementation):
    """transformers accepts any registered implementation for any model; a model that never
    consults the interface then fails with a bare KeyError (Falcon) or silently keeps its own
    attention. For "ulysses" such models are refused with a message that says what to do."""

    def checked(self, requested_attention, is_init_check=False):
        if requested_attention == IMPLEMENTATION and (why := _refusal_of(self)) is not None:
            raise ValueError(why)
        return get_correct_attn_implementation(self, requested_attention, is_init_check)

    return checked


CHECKPOINT_MODES = (None, *tiled.CHECKPOINT_MODES[1:])  # None: "none"
LOSS_TILE_BYTES: int = _C.LOSS_TILE_BYTES  # fp32 logits of one loss tile (tiled.h kLossTileBytes)


@dataclass
class LongSequence:
    """What :func:`sequence_parallel` turned on for a model's long-sequence memory (module
    docstring of ``ulysses.tiled``). ``mlp_tile_tokens``: sequence rows per MLP tile;
    ``loss_tile_bytes``: the fp32 logits of one loss tile."""

    tiled_mlp: bool = False
    tiled_loss: bool = False
    checkpoint: str | None = None
    mlp_tile_tokens: int = 0
    loss_tile_bytes: int = LOSS_TILE_BYTES


def sequence_parallel(model: PreTrainedModel, group: G.GroupLike = None, *,
                      timeout: G.Timeout | G.Wait = None, tiled_mlp: bool = False, tiled_loss: bool = False,
                      checkpoint: str | None = None, mlp_tile_tokens: int | None = None,
                      loss_tile_bytes: int = LOSS_TILE_BYTES,
                      local: str | LocalAttention = "auto", head_chunks: HeadChunks = 1,
                      recompute_chunks: bool = False) -> PreTrainedModel:
    """Makes ``model`` (a ``transformers`` PreTrainedModel) run attention through ulysses over
    ``group`` (any form of ``ulysses.groups.GroupLike``; None: the default group). Turns the KV cache off
    (training; a cache of sharded keys would be wrong). Returns the model.

    Long sequences (``ulysses.tiled``; each exact):

    - ``tiled_mlp``: every decoder layer's ``mlp`` runs in sequence tiles of ``mlp_tile_tokens``
      rows (default: the hidden size), so its intermediate never exists whole;
    - ``tiled_loss``: ``model(..., ulysses_shift_labels=labels)`` returns ``loss`` = this rank's
      *summed* token loss (:func:`token_mean` divides it by the group's token count) and no
      logits: they are made and scored tile by tile. ``ulysses_ignore_index=`` (default ``IGNORE_INDEX``)
      names the ignored label; a rank's bad labels fail every rank alike, before the loss;
    - ``checkpoint="recompute"``: decoder layers keep only their input and recompute in
      backward; ``"offload"``: that input also moves to host memory by a background copy and is
      prefetched back in backward (it frees device memory on a GPU; on a CPU it is a copy).

    The tile counts come from the group's agreed split (``ulysses_seq_lens``, else learned once
    per forward), so they match on every rank.

    ``local`` is every layer's local attention, as ``DistributedAttention`` takes it: a kernel
    name (``"auto"``, ``"fused"``, ``"sdpa"``, ``"math"``, ``"flex"``) or a callable.
    ``head_chunks`` runs every layer's attention in that many chunks of heads, or "auto" for
    each layer's most chunks that replicate no kv head (with ``recompute_chunks``: the most its
    heads allow, up to 8) (``DistributedAttention``'s option: less transient memory, the same
    result); ``recompute_chunks`` makes each chunk keep only its
    inputs for backward and run again there (less memory for one more forward of attention).
    """
    check_head_chunks(head_chunks, "ulysses.hf")
    if not callable(local) and local not in O.LOCAL_KERNELS:
        raise ValueError(f"ulysses.hf: local must be one of {list(O.LOCAL_KERNELS)} or a callable; "
                         f"got {local!r}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"ulysses.hf: checkpoint must be one of {CHECKPOINT_MODES}; got {checkpoint!r}")
    if loss_tile_bytes < 1 or (mlp_tile_tokens is not None and mlp_tile_tokens < 1):
        raise ValueError("ulysses.hf: mlp_tile_tokens and loss_tile_bytes must be >= 1")
    _check_backend(model)
    name = G.group_name(group)
    wait = G.wait(timeout)  # Read once here (Note [One wait]); a G.Wait travels on.
    if model.config._attn_implementation != IMPLEMENTATION:  # What verify's unsharded copy runs.
        object.__setattr__(model, "_ulysses_unsharded_attention", model.config._attn_implementation or "eager")
    sharded = _sharded_implementation(model)
    object.__setattr__(model, "_ulysses_implementation", sharded)
    model.set_attn_implementation(sharded)
    encoders = {id(c) for c in _encoder_configs(model)}
    for module in model.modules():
        if (isinstance(module, PreTrainedModel) and id(module.config) not in encoders
                and module.config._attn_implementation != IMPLEMENTATION):
            raise ValueError(f"ulysses.hf: {type(module).__name__} kept attn_implementation="
                             f"{module.config._attn_implementation!r} after set_attn_implementation('ulysses')")
    model.config.use_cache = False
    for module in model.modules():
        object.__setattr__(module, "_ulysses_group", name)
        object.__setattr__(module, "_ulysses_timeout", wait)
        object.__setattr__(module, "_ulysses_local", local)
        object.__setattr__(module, "_ulysses_head_chunks", head_chunks)
        object.__setattr__(module, "_ulysses_recompute_chunks", bool(recompute_chunks))
        module.__dict__.pop("_ulysses_attention", None)
    object.__setattr__(model, "_ulysses_mixers", hybrid.install(model))
    if vision.is_vision_language(model):
        vision.install(model)
    hidden = model.config.get_text_config().hidden_size
    settings = LongSequence(tiled_mlp, tiled_loss, checkpoint, mlp_tile_tokens or hidden, loss_tile_bytes)
    _install_long_sequence(model, settings)
    return model


def _encoder_configs(model: PreTrainedModel) -> list:
    """The configs of a vision-language model's encoders (they keep their own attention)."""
    if not vision.is_vision_language(model):
        return []
    return [c for c in (getattr(model.config, name, None) for name in vision.ENCODERS) if c is not None]


def _sharded_implementation(model: PreTrainedModel) -> str | dict:
    """What ``set_attn_implementation`` takes under SP: "ulysses", but for a vision-language model's
    encoders, which keep the implementation they had ("sdpa" where they were given "ulysses")."""
    if not vision.is_vision_language(model):
        return IMPLEMENTATION
    implementations = {name: getattr(model.config, name) for name in model.config.sub_configs}
    own = {name: ((c._attn_implementation if c._attn_implementation not in (None, IMPLEMENTATION) else "sdpa")
                  if name in vision.ENCODERS else IMPLEMENTATION)
           for name, c in implementations.items() if c is not None}
    return {"": IMPLEMENTATION, **own}


def long_sequence(model: torch.nn.Module) -> LongSequence | None:
    """The long-sequence settings :func:`sequence_parallel` gave ``model`` (None: not SP)."""
    return model.__dict__.get("_ulysses_long")


def _layers(model: torch.nn.Module) -> list[GradientCheckpointingLayer]:
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _tiled_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An MLP's forward, in sequence tiles (bound to the MLP: a deep copy rebinds to the copy)."""
    if x.dim() != 3:
        raise ValueError(f"ulysses.hf: tiled_mlp expects [B, S_r, E] hidden states; got {list(x.shape)}")
    rows = tiled.current_rows() or x.shape[1]  # the largest rank's, when the forward declared it
    tiles = tiled.tile_count(rows, mlp.__dict__["_ulysses_mlp_tile_tokens"])
    return tiled.tiled_mlp(functools.partial(type(mlp).forward, mlp), x, tiles, dim=1)


def _install_long_sequence(model: PreTrainedModel, settings: LongSequence) -> None:
    """Binds the model's forward (declares the sequence rows, takes ulysses_shift_labels) and,
    as asked, its MLPs' forwards, and turns on its layers' checkpointing. A second call
    replaces what the first did."""
    object.__setattr__(model, "_ulysses_long", settings)
    # The sharded sequence's layers: a VLM's language model's, not its towers' (whole images).
    for layer in _layers(vision.language_model(model) if vision.is_vision_language(model) else model):
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, torch.nn.Module):
            mlp.__dict__.pop("forward", None)
            if settings.tiled_mlp:
                object.__setattr__(mlp, "_ulysses_mlp_tile_tokens", settings.mlp_tile_tokens)
                mlp.forward = types.MethodType(_tiled_mlp_forward, mlp)
    if settings.checkpoint is not None:
        model.activation_checkpointing_enable()  # its layers then call the function set per forward
    model.forward = types.MethodType(_forward_with_signature(type(model)), model)


def _forward_with_signature(model_class: type[PreTrainedModel]) -> Callable:
    """_long_sequence_forward under the signature of ``model_class.forward`` plus its own keyword
    arguments: callers that read the signature (the Trainer keeps the dataset columns it names,
    with remove_unused_columns=True by default) see the model's inputs, not ``*args, **kwargs``."""
    original = inspect.signature(model_class.forward)
    params = [p for p in original.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in params}
    ours = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
            for name, default in (("ulysses_shift_labels", None), ("ulysses_ignore_index", IGNORE_INDEX))
            if name not in names]
    rest = [p for p in original.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]

    def forward(self, *args, **kwargs):
        return _long_sequence_forward(self, *args, **kwargs)

    forward.__signature__ = original.replace(parameters=params + ours + rest)  # type: ignore[attr-defined]
    forward.__doc__ = _long_sequence_forward.__doc__
    return forward


def _use_our_checkpoint(model: torch.nn.Module, settings: LongSequence) -> None:
    """Layers with checkpointing on (ours, or transformers' turned on by a Trainer) run
    ulysses.tiled.checkpoint: its recompute replays the declared rows, so tiles cut alike."""
    ours = functools.partial(tiled.checkpoint, mode=settings.checkpoint or "none")
    for layer in _layers(model):
        if layer.gradient_checkpointing:
            layer.__dict__["_gradient_checkpointing_func"] = ours  # a plain attribute, not a submodule


def _tokens(kwargs: dict) -> torch.Tensor:
    """The forward's input_ids or inputs_embeds ``[B, S_r, ...]``."""
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None:
        raise ValueError("ulysses.hf: the model needs input_ids or inputs_embeds (by keyword) under "
                         "sequence parallelism")
    return x


def _sequence_rows(kwargs: dict, group: str, timeout: G.Wait) -> list[int]:
    given = kwargs.get("ulysses_seq_lens")
    if given:
        return list(given)
    return O.sequence_lengths(_tokens(kwargs), 1, group, timeout)


def _global_positions(x: torch.Tensor, seq_lens: list[int], group: str) -> torch.Tensor:
    """This shard's positions of the unsharded forward's default ``0..S-1``, ``[B, S_r]``: without
    them transformers would number each shard from 0 (RoPE on local positions, and every shard
    a document of its own). Built from the agreed split, so they match on every rank."""
    rank = G.rank_and_size(group)[0]
    start = sum(seq_lens[:rank])
    return torch.arange(start, start + seq_lens[rank], device=x.device).expand(x.shape[0], -1)


def _logit_rules(config) -> tuple[float, float]:
    """(scale, softcap) a causal LM applies to its logits after lm_head (Cohere's logit_scale,
    Granite's logits_scaling, Gemma's final_logit_softcapping)."""
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)
    return scale, float(getattr(config, "final_logit_softcapping", None) or 0.0)


@contextlib.contextmanager
def _shard_forward(model: PreTrainedModel, seq_lens: list[int]) -> Iterator[dict]:
    """What a forward of this rank's shard runs inside: the keyword arguments its layers take (the
    agreed split, so no layer learns it, and one StepContext, so the layers share the gathered
    padding mask, rebuilt mask and position ids, a checkpoint's recompute too), the declared
    sequence rows (tiles cut alike on every rank) and the offload scope."""
    settings: LongSequence = model.__dict__["_ulysses_long"]
    if settings.tiled_mlp or settings.checkpoint:
        _use_our_checkpoint(model, settings)
    with tiled.sequence_rows(max(seq_lens)), tiled.offload_scope():
        yield {"ulysses_seq_lens": seq_lens, "ulysses_step": StepContext()}


# The per-token fields of TRL's fused LM head output (trl's add_fused_lm_head).
_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@contextlib.contextmanager
def unsharded(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Inside, the sequence-parallel ``model`` runs as it did before :func:`sequence_parallel`, on
    the whole sequences each rank holds: its own attention implementation and forward, no
    exchange, no collective, and a KV cache where the caller asks for one. For generation (every
    rank has the whole prompt; transformers' ``generate``); training forwards stay sharded.
    Yields the model; leaves it sequence-parallel again on exit."""
    if "_ulysses_long" not in model.__dict__:
        raise ValueError(f"ulysses.hf: unsharded() takes a model made sequence-parallel by sequence_parallel(); "
                         f"{type(model).__name__} is not")
    if model.__dict__.get("_ulysses_whole"):
        yield model
        return
    model.set_attn_implementation(model.__dict__.get("_ulysses_unsharded_attention", "eager"))
    object.__setattr__(model, "_ulysses_whole", True)
    try:
        yield model
    finally:
        del model.__dict__["_ulysses_whole"]
        model.set_attn_implementation(model.__dict__.get("_ulysses_implementation", IMPLEMENTATION))


def _check_same_batch(input_ids: torch.Tensor, group: str, images: list[float] | None = None,
                      timeout: G.Timeout | G.Wait = None) -> None:
    """Every rank of an SP group scores the same whole sequences: their shapes and a digest of
    their tokens (and of a VLM's ``images``: :func:`ulysses.vision.images_digest`) agree, or every
    rank raises the same error naming each rank's (one small collective, before any exchange; a
    shard of another rank's sequences would be a silent wrong)."""
    size = G.rank_and_size(group)[1]
    flat = input_ids.reshape(-1).long()
    weights = (torch.arange(1, flat.numel() + 1, device=flat.device) * 2654435761) % 2147483647
    # The images' float64 digest rides bit for bit as int64 beside the tokens': one round.
    pictures = torch.tensor(images or [], dtype=torch.float64).view(torch.int64).to(flat.device)
    mine = torch.cat([torch.stack([torch.tensor(input_ids.shape[0], device=flat.device),
                                   torch.tensor(input_ids.shape[-1], device=flat.device), (flat * weights).sum()]),
                      pictures])
    every = O.all_gather_sequence(mine[None], 0, [1] * size, group, timeout).tolist()
    if any(s[:2] != every[0][:2] for s in every):
        each = ", ".join(f"rank {r} has {s[0]}x{s[1]}" for r, s in enumerate(every))
        raise ValueError("ulysses.hf: the ranks of a sequence-parallel group score the same batch of whole "
                         f"sequences (B x S), and they differ: {each}")
    if any(s[2] != every[0][2] for s in every):
        differ = [r for r, s in enumerate(every) if s[2] != every[0][2]]
        raise ValueError("ulysses.hf: the ranks of a sequence-parallel group score the same batch of whole "
                         f"sequences, and rank(s) {differ} hold other tokens than rank 0 (same shape "
                         f"{every[0][0]}x{every[0][1]}): feed every rank of the group the same batch")
    if any(s[3:] != every[0][3:] for s in every):
        differ = [r for r, s in enumerate(every) if s[3:] != every[0][3:]]
        raise ValueError(f"ulysses.hf: the ranks of a sequence-parallel group run a vision-language model on the "
                         f"same whole batch, and rank(s) {differ} hold other images, grids or positions than rank 0 "
                         f"({', '.join(vision.IMAGE_KEYS)}): feed every rank of the group the same batch")


def whole_sequence_fused_forward(model: PreTrainedModel, fused_forward: Callable, *, input_ids: torch.Tensor,
                                 labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                 position_ids: torch.Tensor | None = None, **kwargs) -> Any:
    """TRL's fused LM head (``fused_forward``: the model's forward as trl's ``add_fused_lm_head``
    made it) over whole sequences ``[B, S]``, run sequence-parallel: this rank's shard of the batch
    (:func:`shard_batch`: labels shifted on the whole sequence) is scored with its pre-shifted
    labels, and each per-token field (log-probabilities, entropy, ...) is gathered along the
    sequence, ``[B, S - 1]`` as the unsharded head returns them. Every rank then computes the
    trainer's loss over whole sequences; the gather's backward sums every rank's copy, so each
    rank's gradient is P times its tokens' part (what an average over the SP ranks wants)."""
    group = model.__dict__["_ulysses_group"]
    _check_same_batch(input_ids, group)
    whole = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "position_ids": position_ids}
    shard = shard_batch({k: v for k, v in whole.items() if v is not None}, group)
    seq_lens = shard["seq_lens"]
    _refuse_documents_for_mixers(model, shard["position_ids"], shard.get("attention_mask"), seq_lens)
    with _shard_forward(model, seq_lens) as extra:
        out = fused_forward(input_ids=shard["input_ids"], attention_mask=shard.get("attention_mask"),
                            position_ids=shard["position_ids"], shift_labels=shard["shift_labels"],
                            fused_lm_head=True, **extra, **kwargs)
    for name in _PER_TOKEN_FIELDS:
        value = getattr(out, name, None)
        if value is not None:
            setattr(out, name, O.all_gather_sequence(value, 1, seq_lens, group)[:, :-1])
    if getattr(out, "loss", None) is not None:
        out.loss = None  # this shard's alone: trainers read the gathered fields
    return out


def _refuse_documents_for_mixers(model: PreTrainedModel, positions: torch.Tensor, attention_mask, seq_lens) -> None:
    """Packed rows of a model with mixers outside attention fail every rank alike
    (``ulysses.hybrid.refuse_documents``)."""
    if model.__dict__.get("_ulysses_mixers"):
        hybrid.refuse_documents(type(model), positions, attention_mask, seq_lens, model.__dict__["_ulysses_group"],
                                model.__dict__["_ulysses_timeout"])


def _vision_language_forward(model: PreTrainedModel, kwargs: dict, shift_labels: torch.Tensor | None,
                             ignore_index: int):
    """A vision-language model's forward under SP (``ulysses.vision``): the whole batch on every
    rank, this rank's shard of the logits back (or, given ``shift_labels``, its tiled loss)."""
    group, timeout = model.__dict__["_ulysses_group"], model.__dict__["_ulysses_timeout"]
    ids = kwargs.get("input_ids")
    if ids is None:
        raise ValueError("ulysses.hf: a vision-language model under sequence parallelism takes the whole batch's "
                         "input_ids (by keyword) on every rank")
    if kwargs.get("labels") is not None:
        raise ValueError("ulysses.hf: a vision-language model under sequence parallelism returns this rank's shard "
                         "of the logits: give labels to shard_batch and score its shift_labels with "
                         "sequence_parallel_loss, not labels to the model")
    _check_same_batch(ids, group, vision.images_digest(kwargs), timeout)
    problem = vision.positions_problem(model, kwargs.get("position_ids"))
    if problem:  # (the positions are in the digest, alike on every rank: each raises alike)
        raise ValueError(f"ulysses.hf: {problem}")
    seq_lens = list(kwargs.get("ulysses_seq_lens") or vision.even_split(ids.shape[1], G.rank_and_size(group)[1]))
    with _shard_forward(model, seq_lens) as extra:
        kwargs.update(extra)
        if kwargs.get("token_type_ids") is not None:  # Gemma 3's image blocks, on the whole sequence
            kwargs["ulysses_blocks"] = vision.image_blocks(kwargs["token_type_ids"])
        with vision.images_shared(model):
            if shift_labels is None:
                return type(model).forward(model, **kwargs)
            return _tiled_loss(model, kwargs, seq_lens, shift_labels, ignore_index)


def _long_sequence_forward(model: PreTrainedModel, *args, ulysses_shift_labels: torch.Tensor | None = None,
                           ulysses_ignore_index: int = IGNORE_INDEX, **kwargs):
    """The model's forward under sequence parallelism (bound to the model: a deep copy rebinds)."""
    if model.__dict__.get("_ulysses_whole"):  # inside unsharded(model)
        return type(model).forward(model, *args, **kwargs)
    if args:
        raise ValueError("ulysses.hf: pass the model's inputs by keyword under sequence parallelism")
    if vision.is_vision_language(model):
        return _vision_language_forward(model, kwargs, ulysses_shift_labels, ulysses_ignore_index)
    seq_lens = _sequence_rows(kwargs, model.__dict__["_ulysses_group"], model.__dict__["_ulysses_timeout"])
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = _global_positions(_tokens(kwargs), seq_lens, model.__dict__["_ulysses_group"])
    else:
        _refuse_documents_for_mixers(model, kwargs["position_ids"], kwargs.get("attention_mask"), seq_lens)
    with _shard_forward(model, seq_lens) as extra:
        kwargs.update(extra)
        if ulysses_shift_labels is None:
            return type(model).forward(model, **kwargs)
        return _tiled_loss(model, kwargs, seq_lens, ulysses_shift_labels, ulysses_ignore_index)


def _tiled_loss(model: PreTrainedModel, kwargs: dict, seq_lens: list[int], shift_labels: torch.Tensor,
                ignore_index: int) -> CausalLMOutputWithPast:
    """This rank's summed token loss of its shard (inside ``_shard_forward``): the base model's
    hidden states through the output head and the cross-entropy in tiles, never the whole
    logits (``sequence_parallel(..., tiled_loss=True)``)."""
    if not model.__dict__["_ulysses_long"].tiled_loss:
        raise ValueError("ulysses.hf: ulysses_shift_labels needs sequence_parallel(..., tiled_loss=True)")
    if kwargs.pop("labels", None) is not None:
        raise ValueError("ulysses.hf: give ulysses_shift_labels or labels, not both")
    kwargs.pop("logits_to_keep", None)
    hidden = getattr(model, model.base_model_prefix)(**kwargs).last_hidden_state
    head = model.get_output_embeddings()
    # Every rank reaches this point; one agreement round here makes a rank's bad labels fail
    # every rank alike, before the ranks part ways (its loss would raise, theirs would wait).
    group = model.__dict__["_ulysses_group"]
    problem = tiled.label_problem(hidden, head.weight.shape[0], shift_labels, ignore_index)
    _C.check_together(f"ulysses.hf: {problem}" if problem else "", G.group_name(group),
                      model.__dict__["_ulysses_timeout"].code(), "ulysses.hf tiled loss labels")
    scale, softcap = _logit_rules(model.config)  # (the head's own: a VLM's config, not its text config's)
    tiles = _C.loss_tile_count(hidden.shape[0] * max(seq_lens), head.weight.shape[0],
                               model.__dict__["_ulysses_long"].loss_tile_bytes)
    loss = tiled._checked_linear_cross_entropy(hidden, head.weight, shift_labels, bias=head.bias, tiles=tiles,
                                               ignore_index=ignore_index, scale=scale, softcap=softcap)
    return CausalLMOutputWithPast(loss=loss)


@dataclass
class Verification:
    """What :func:`verify` found: the relative error of the global loss and of every parameter's
    gradient (summed over the group) against the same model unsharded, the worst of each rank's
    (the same on every rank)."""

    loss_error: float
    gradient_errors: dict[str, float]

    @property
    def worst(self) -> tuple[str, float]:
        """The parameter whose gradient is the furthest off, and its error ("loss" where the loss
        is further off than every gradient)."""
        name, error = max(self.gradient_errors.items(), key=lambda item: item[1], default=("loss", 0.0))
        return ("loss", self.loss_error) if self.loss_error >= error else (name, error)

    def __str__(self) -> str:
        name, error = self.worst
        return (f"loss relative error {self.loss_error:.3g}; worst of {len(self.gradient_errors)} gradients: "
                f"{max(self.gradient_errors.values(), default=0.0):.3g}; worst overall: {name} ({error:.3g})")


@contextlib.contextmanager
def _as_before_sequence_parallel(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Inside, the sequence-parallel ``model`` itself runs as it did before
    :func:`sequence_parallel` (its own attention, forwards and MLPs, no checkpointing, no ulysses
    state): what :func:`verify` compares against, on the same parameters, so the device never
    holds a second copy of the weights. Everything is put back on exit."""
    kept: list[tuple[torch.nn.Module, dict, bool]] = []  # (module, its ulysses entries and forwards, checkpointing)
    for module in model.modules():
        entries = {k: v for k, v in module.__dict__.items() if k.startswith("_ulysses_") or k == "forward"}
        for key in entries:
            del module.__dict__[key]
        checkpointing = bool(getattr(module, "gradient_checkpointing", False))
        if isinstance(module, GradientCheckpointingLayer):
            module.gradient_checkpointing = False
        kept.append((module, entries, checkpointing))
    model.set_attn_implementation(kept[0][1].get("_ulysses_unsharded_attention", "eager"))
    try:
        yield model
    finally:
        for module, entries, checkpointing in kept:
            module.__dict__.update(entries)
            if isinstance(module, GradientCheckpointingLayer):
                module.gradient_checkpointing = checkpointing
        model.set_attn_implementation(model.__dict__.get("_ulysses_implementation", IMPLEMENTATION))


def _relative_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return 0.0 if got is None and (want is None or not want.any()) else float("inf")
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def verify(model: PreTrainedModel, batch: dict, group: G.GroupLike = None, *,
           reduce_gradients: Callable[[list[torch.Tensor], str], None] | None = None,
           tolerance: float | None = None) -> Verification:
    """Runs one forward and backward of the sequence-parallel ``model`` on this rank's shard of
    ``batch`` (unsharded ``[B, S]``: ``input_ids``, optional ``labels``, ``attention_mask``,
    ``position_ids``, as :func:`shard_batch` takes it; a vision-language model's images, grids and
    ``mm_token_type_ids`` too) and the same unsharded on the whole batch,
    on every rank, and returns the relative error of the global loss and of every parameter's
    gradient, each rank's worst taken over ``group`` (so every rank returns the same). Nothing is
    trained: gradients are computed with ``torch.autograd.grad`` and never reach ``.grad`` (nor a
    DDP hook). ``reduce_gradients(grads, group_name)`` sums the sharded gradients over the group
    in place (default: ``all_reduce_gradients``'s one collective); pass another to check a
    reduction of your own. Logs the result at INFO on ``ulysses.hf``; with ``tolerance``, raises
    ``ValueError`` (on every rank alike) naming the worst parameter when it is above it.
    The unsharded run is the model itself with its sequence-parallel state set aside
    (``_as_before_sequence_parallel``): the device holds the weights once, and two sets of
    gradients (the reference's and the sharded run's) at the end. The last round runs over the
    group's CPU side backend where it has none of its own (an NCCL-only group). Models sharded by
    FSDP are not supported (each rank holds a shard)."""
    name = G.group_name(group)
    wait = G.wait(model.__dict__.get("_ulysses_timeout"))
    G.with_cpu_backend(name, wait)  # The errors' round moves host floats, whatever the group's device.
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    whole = torch.ops.ulysses.shard_batch(batch["input_ids"], batch.get("labels"), batch.get("attention_mask"),
                                          batch.get("position_ids"), 0, 1, 1, IGNORE_INDEX)
    text = ("input_ids", "labels", "attention_mask", "position_ids")
    extra = {k: v for k, v in batch.items() if k not in text}  # a vision-language model's images
    if extra and not vision.is_vision_language(model):
        raise ValueError(f"ulysses.hf.verify: the batch takes {', '.join(text)} (and a vision-language model's "
                         f"images); got {sorted(extra)} too")
    with _as_before_sequence_parallel(model) as reference:
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                           position_ids=batch.get("position_ids"), **extra).logits
        ref_loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), whole[1].flatten(),
                                                     ignore_index=IGNORE_INDEX)
        ref_grads = torch.autograd.grad(ref_loss, [p for _, p in params], allow_unused=True)
    del logits
    shard = shard_batch({k: v for k, v in batch.items() if k in text}, name)
    if vision.is_vision_language(model):  # the whole batch on every rank (ulysses.vision)
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    ulysses_seq_lens=shard["seq_lens"], **extra)
    else:
        out = model(input_ids=shard["input_ids"], attention_mask=shard.get("attention_mask"),
                    position_ids=shard["position_ids"], ulysses_seq_lens=shard["seq_lens"], **extra)
    loss, global_loss = sequence_parallel_loss(out.logits, shard["shift_labels"], name)
    grads = list(torch.autograd.grad(loss, [p for _, p in params], allow_unused=True))
    grads = [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, params)]
    (reduce_gradients or _sum_gradients)(grads, name)
    errors = [abs(global_loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)]
    errors += [_relative_error(g, r) for g, r in zip(grads, ref_grads)]
    # Every rank's worst, so every rank returns (and raises) the same.
    size = G.rank_and_size(name)[1]
    worst = O.all_gather_sequence(torch.tensor([errors], dtype=torch.float64), 0, [1] * size, name, wait).amax(0)
    result = Verification(worst[0].item(), {n: e for (n, _), e in zip(params, worst[1:].tolist())})
    _log.info("ulysses.hf.verify: %s", result)
    if tolerance is not None and result.worst[1] > tolerance:
        raise ValueError(f"ulysses.hf.verify: the sharded model differs from itself unsharded above {tolerance:g}: "
                         f"{result}")
    return result


def _sum_gradients(grads: list[torch.Tensor], group: str) -> None:
    torch.ops.ulysses.all_reduce_gradients(grads, group, G.group_options(None))


PreTrainedModel.get_correct_attn_implementation = _refuse_incompatible(  # type: ignore[method-assign]
    PreTrainedModel.get_correct_attn_implementation)

__all__ = ["IMPLEMENTATION", "LongSequence", "Verification", "all_reduce_gradients", "long_sequence",
           "sequence_parallel", "sequence_parallel_loss", "shard_batch", "token_mean", "ulysses_attention_forward",
           "unsharded", "verify", "whole_sequence_fused_forward"]
