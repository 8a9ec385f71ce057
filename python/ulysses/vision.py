"""Vision-language models under sequence parallelism (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, the LLaVA
family, Mistral 3, Idefics3, SmolVLM, InternVL; ``MODELS``): the vision tower keeps its own attention,
and the language model takes its shard of the merged sequence.

Every rank of an SP group runs the model's forward on the whole batch (input_ids ``[B, S]``,
pixel values, grids), so the model's own rules run on the whole sequence as they do unsharded:
the vision tower encodes the images (each image or frame on one rank of the group, the outputs
all-gathered: ``_encoded_once``, ``_images_encoded_once``), their embeddings are merged into the
text sequence, and the multimodal rotary positions (mrope: ``[3, B, S]`` from ``get_rope_index``,
with its video time axis) are made. Then, at the language model's door, each rank keeps its shard of the merged
embeddings, of the positions and of the padding mask (the agreed split, ``shard_batch``'s), and
the language model runs sharded, its attention through ulysses. Gradients of the vision tower
on each rank are its images' part; ``all_reduce_gradients`` sums them, as every parameter's.

``ulysses.hf`` binds this (``sequence_parallel``); the model's forward then returns this rank's
shard of the logits, scored with ``shard_batch``'s ``shift_labels`` (``sequence_parallel_loss``).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from . import _C
from . import groups as G
from . import ops as O

#: The VLM classes whose merge and positions are made on the whole sequence by their own forward,
#: then sharded at their language model (``language_model``, Idefics3's ``text_model``, called
#: with ``inputs_embeds``): the tower, tiling and projector run as unsharded.
MODELS = frozenset(f"{family}{suffix}" for suffix in ("ForConditionalGeneration", "Model") for family in (
    "Qwen2VL", "Qwen2_5_VL", "Qwen3VL", "Qwen3VLMoe", "Llava", "LlavaNext", "LlavaNextVideo", "LlavaOnevision",
    "Mistral3", "Idefics3", "SmolVLM", "InternVL", "Gemma3"))
#: Those whose vision tower encodes each frame on its own (attention within a frame, positions
#: from its grid) and returns the merged embeddings the merge reads (and Qwen3-VL's, deepstack
#: features of inner blocks, merged alike).
ENCODED_ONCE = frozenset({"Qwen2VLForConditionalGeneration", "Qwen2VLModel", "Qwen2_5_VLForConditionalGeneration",
                          "Qwen2_5_VLModel", "Qwen3VLForConditionalGeneration", "Qwen3VLModel",
                          "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeModel"})
#: The others: their image tower encodes each image of its input on its own (CLIP, SigLIP,
#: InternViT and Idefics3's at one size; Pixtral at any size, its images one sequence with
#: attention within each image), so each image is encoded once per group (``_images_encoded_once``).
IMAGES_ENCODED_ONCE = MODELS - ENCODED_ONCE
#: What their batches carry besides the text (each rank of an SP group holds the whole batch).
BATCH_KEYS = frozenset({"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                        "second_per_grid_ts", "mm_token_type_ids", "image_sizes", "pixel_attention_mask",
                        "token_type_ids"})
#: The sub-configs of their encoders, which keep their own attention implementation.
ENCODERS = ("vision_config",)


def positions_problem(model: torch.nn.Module, position_ids: torch.Tensor | None) -> str:
    """Why a batch's ``position_ids`` cannot go to this VLM, or "". Given, they mark packed rows
    (each document's positions restart, and its attention keeps to itself, as for text models):
    ``[B, S]``, or for the mrope models (ENCODED_ONCE) ``[4, B, S]``, the text positions and then
    each document's own mrope positions, as their language models take packed rows."""
    if position_ids is None:
        return ""
    name, shape = type(model).__name__, list(position_ids.shape)
    if any(c.__name__ in ENCODED_ONCE for c in type(model).__mro__):
        if position_ids.dim() != 3 or shape[0] != 4:
            return (f"{name} makes its mrope positions from its images: packed rows carry position_ids [4, B, S] "
                    f"(each document's text positions, then its own get_rope_index positions), or none; got {shape}")
    elif position_ids.dim() != 2:
        return f"{name}'s packed rows carry position_ids [B, S], restarting at each document, or none; got {shape}"
    return ""


def text_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The ``[B, S]`` text positions of a batch's position ids (the first of Qwen-VL's ``[4, B, S]``):
    where its documents start, as ``shard_batch`` reads them."""
    return position_ids[0] if position_ids is not None and position_ids.dim() == 3 else position_ids


def is_vision_language(model: torch.nn.Module) -> bool:
    """One of MODELS, or a class made from one (FSDP2's ``fully_shard`` subclasses the model's)."""
    return any(c.__name__ in MODELS for c in type(model).__mro__)


def even_split(seq_len: int, size: int) -> list[int]:
    """Every rank's token count of a ``seq_len`` sequence (``shard_batch``'s rule, in C++, which
    gives each rank's ``(begin, end)``)."""
    return [end - begin for begin, end in _C.even_split(seq_len, size)]


def language_model(model: Any) -> Any:
    """A VLM's language model (``language_model``, Idefics3's ``text_model``)."""
    inner = getattr(model, "model", model)
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


def _narrow(x: torch.Tensor | None, dim: int, seq_lens: list[int], rank: int) -> torch.Tensor | None:
    if x is None:
        return None
    return x.narrow(dim, sum(seq_lens[:rank]), seq_lens[rank])


def image_blocks(token_type_ids: torch.Tensor) -> torch.Tensor | None:
    """Gemma 3's bidirectional image blocks: ``[B, S]`` ids, n for the tokens of a row's n-th run
    of image tokens (``token_type_ids`` 1), -1 for text; None when the batch has no image token."""
    image = token_type_ids == 1
    if not bool(image.any()):
        return None
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]
    return torch.where(image, starts.long().cumsum(1) - 1, -1)


def block_masks(blocks: torch.Tensor, padding: torch.Tensor | None, window: int, begin: int,
                rows: int) -> dict[str, torch.Tensor]:
    """The attention masks of this rank's query rows ``[begin, begin + rows)`` over all S keys,
    ``[B, 1, rows, S]`` bool, by Gemma 3's layer kind: a query sees the keys before it and every
    key of its own image block (``image_blocks``), and not the padding; a sliding layer only those
    within ``window`` behind it. A dense mask (rows x S per rank, rebuilt over the group before the
    kernel once per step): the kernels' rules are causal or not, and this is neither."""
    S = blocks.shape[1]
    q = torch.arange(begin, begin + rows, device=blocks.device)[:, None]
    k = torch.arange(S, device=blocks.device)[None, :]
    mine = blocks[:, begin:begin + rows, None]
    seen = (k <= q) | ((mine == blocks[:, None, :]) & (mine >= 0))
    if padding is not None:
        seen = seen & padding.bool()[:, None, :]
    full = seen[:, None]
    return {"full_attention": full, "sliding_attention": full & (k > q - window) if window else full}


def _sharded_masks(language_model: Any, mask: Any, blocks: torch.Tensor | None, seq_lens: list[int],
                   rank: int) -> tuple[Any, bool]:
    """This rank's share of the language model's ``attention_mask``, and whether it is a dense
    mask that stands for every rule (``block_masks``). A 2-D padding mask is narrowed to the
    shard (the attention gathers it); Gemma 3's masks by layer kind are the 2-D padding mask each
    (the "ulysses" mask interface made them), or, with image blocks, the dense block masks."""
    if isinstance(mask, dict):
        padding = mask.get("full_attention")
        if blocks is not None:
            window = int(getattr(language_model.config, "sliding_window", None) or 0)
            return block_masks(blocks, padding, window, sum(seq_lens[:rank]), seq_lens[rank]), True
        return {kind: _narrow(m, 1, seq_lens, rank) for kind, m in mask.items()}, False
    if mask is not None and mask.dim() != 2:
        raise ValueError("ulysses.hf: a vision-language model under sequence parallelism takes a 2-D padding "
                         f"mask [B, S]; got {list(mask.shape)}")
    return _narrow(mask, 1, seq_lens, rank), False


def _sharded_language_model(language_model: Any, *args, **kwargs):
    """The language model's forward on this rank's shard of the merged sequence (bound to it)."""
    seq_lens = kwargs.get("ulysses_seq_lens")
    blocks = kwargs.pop("ulysses_blocks", None)
    if not seq_lens or args:
        return type(language_model).forward(language_model, *args, **kwargs)
    group = language_model.__dict__["_ulysses_group"]
    rank = G.rank_and_size(group)[0]
    embeds = kwargs["inputs_embeds"]
    if embeds.shape[1] != sum(seq_lens):
        raise ValueError(f"ulysses.hf: the language model of a vision-language model takes the whole merged "
                         f"sequence ({embeds.shape[1]} tokens here) and keeps its shard of the agreed split "
                         f"{seq_lens}: give the model the whole batch on every rank")
    mask, dense = _sharded_masks(language_model, kwargs.get("attention_mask"), blocks, seq_lens, rank)
    if dense:
        kwargs["ulysses_dense_mask"] = True  # (the attention runs it with no causal or window rule)
    positions = kwargs.get("position_ids")
    if positions is None:  # (the language model's default: 0..S-1 on the whole sequence)
        positions = torch.arange(embeds.shape[1], device=embeds.device).expand(embeds.shape[0], -1)
    kwargs.update(inputs_embeds=_narrow(embeds, 1, seq_lens, rank), attention_mask=mask,
                  position_ids=_narrow(positions, positions.dim() - 1, seq_lens, rank))
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:  # Qwen3-VL's deepstack: the features of this shard's vision tokens
        order = visual.flatten().cumsum(0).reshape(visual.shape) - 1  # each vision token's row in them
        mine = visual.narrow(1, sum(seq_lens[:rank]), seq_lens[rank])
        rows = order.narrow(1, sum(seq_lens[:rank]), seq_lens[rank])[mine]
        kwargs["visual_pos_masks"] = mine
        kwargs["deepstack_visual_embeds"] = [e.index_select(0, rows) for e in kwargs["deepstack_visual_embeds"]]
    return type(language_model).forward(language_model, **kwargs)


def frame_split(grid_thw: torch.Tensor, size: int) -> list[list[tuple[int, int, int, int]]]:
    """The frames (an image is one; a video has t) of ``grid_thw`` ``[N, 3]`` split over ``size``
    ranks in order, balanced by patches: for each rank, its runs ``(item, first frame, frames,
    patches per frame)``. A rank may get none (more ranks than frames)."""
    frames = [(item, f, int(h * w)) for item, (t, h, w) in enumerate(grid_thw.tolist()) for f in range(int(t))]
    total = sum(p for _, _, p in frames)
    runs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(size)]
    done = 0
    for item, f, patches in frames:
        rank = min(size - 1, done * size // max(total, 1))  # where this frame's first patch falls
        done += patches
        last = runs[rank][-1] if runs[rank] else None
        if last is not None and last[0] == item and last[1] + last[2] == f:
            runs[rank][-1] = (item, last[1], last[2] + 1, patches)
        else:
            runs[rank].append((item, f, 1, patches))
    return runs


def _last_linear(merger: torch.nn.Module) -> torch.nn.Linear:
    """A patch merger's last linear layer: the one that makes its output rows."""
    return [m for m in merger.modules() if isinstance(m, torch.nn.Linear)][-1]


def _merged_width(merger: torch.nn.Module) -> int:
    """The width of a patch merger's output rows."""
    return _last_linear(merger).out_features


def _merged_dtype(merger: torch.nn.Module, device: torch.device) -> torch.dtype:
    """The dtype of a patch merger's output rows, as a rank that encodes frames gets them: its
    last linear layer's output, which autocast (when on for ``device``) makes autocast's dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return _last_linear(merger).weight.dtype


def _encoded_once(visual: Any, pixels: torch.Tensor, grid_thw: torch.Tensor | None = None, **kwargs):
    """The vision tower's forward (bound to it) under SP: each rank encodes its frames of the
    batch's images and videos (``frame_split``; a video's frames are encoded independently, so
    any split of them is exact), and one all-gather hands every rank every frame's merged
    embeddings, in order, with Qwen3-VL's deepstack features side by side with them; its backward
    returns each frame's gradient to the rank that encoded it. Only what the merge reads
    (``pooler_output``, ``deepstack_features``) is whole; the other fields are dropped."""
    seq_lens = kwargs.get("ulysses_seq_lens")
    if not seq_lens or grid_thw is None:
        return type(visual).forward(visual, pixels, grid_thw=grid_thw, **kwargs)
    group, timeout = visual.__dict__["_ulysses_group"], visual.__dict__.get("_ulysses_timeout")
    rank, size = G.rank_and_size(group)
    merge = visual.spatial_merge_size ** 2
    starts = torch.cat([grid_thw.new_zeros(1), grid_thw.prod(-1).cumsum(0)]).tolist()  # each item's first row
    runs = frame_split(grid_thw, size)
    tokens = [sum(n * p for _, _, n, p in mine) // merge for mine in runs]
    mergers = [visual.merger, *getattr(visual, "deepstack_merger_list", [])]
    widths = [_merged_width(m) for m in mergers]
    mine = runs[rank]
    if mine:
        rows = [pixels[starts[item] + first * p: starts[item] + (first + n) * p] for item, first, n, p in mine]
        grid = torch.tensor([[n, *grid_thw[item, 1:].tolist()] for item, _, n, _ in mine], device=grid_thw.device)
        out = type(visual).forward(visual, torch.cat(rows), grid_thw=grid, **kwargs)
        own = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=1)
    else:  # no frame here: an empty shard of the embeddings, in the dtype the others' come in
        out = None
        own = pixels.new_zeros(0, sum(widths), dtype=_merged_dtype(mergers[0], pixels.device))
        trained = [p for p in visual.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
        if trained:
            # Every trained tower parameter takes part, with a zero gradient: DDP and FSDP2 reduce
            # the same parameters' gradients on every rank (and the all-gather's backward runs on
            # every rank, as on those that encoded frames; a frozen tower has none anywhere).
            own = own + torch.stack([p.sum() for p in trained]).sum() * 0
    whole = O.all_gather_sequence(own, 0, tokens, group, timeout).split(widths, dim=1)
    fields: dict = {"pooler_output": whole[0]}
    if len(mergers) > 1:
        fields["deepstack_features"] = list(whole[1:])
    if out is not None:
        return type(out)(**fields)
    output_type = getattr(sys.modules[type(visual).__module__], "BaseModelOutputWithDeepstackFeatures",
                          BaseModelOutputWithPooling)
    return output_type(**fields)


def _image_tower(model: Any) -> Any:
    """The vision tower of a model of IMAGES_ENCODED_ONCE."""
    inner = getattr(model, "model", model)
    return inner.vision_tower if hasattr(inner, "vision_tower") else inner.vision_model


def _feature_layers(config: Any) -> list[int]:
    """The tower's hidden states the model reads besides its last one (``vision_feature_layer``)."""
    layer = getattr(config, "vision_feature_layer", -1)
    return [layer] if isinstance(layer, int) else list(layer)


@contextlib.contextmanager
def images_shared(model: Any):
    """Within: the model's image tower (IMAGES_ENCODED_ONCE) encodes each image once per group
    (``_images_encoded_once``); outside (``unsharded``, a tower called on its own) it runs whole."""
    tower = _image_tower(model) if any(c.__name__ in IMAGES_ENCODED_ONCE for c in type(model).__mro__) else None
    if tower is None:
        yield
        return
    object.__setattr__(tower, "_ulysses_share_images", True)
    try:
        yield
    finally:
        object.__setattr__(tower, "_ulysses_share_images", False)


def _images_encoded_once(tower: Any, pixel_values: torch.Tensor | None = None, *args, **kwargs):
    """The image tower's forward (bound to it) under SP, for towers that encode each image of
    ``pixel_values`` ``[N, ...]`` on its own (CLIP, SigLIP, InternViT, Idefics3's: outputs
    ``[N, tokens, width]``; Pixtral: images of any size as one sequence, block by block, outputs
    ``[1, all tokens, width]``): each rank encodes its even share of the N images (and of every
    per-image input, PER_IMAGE_KEYS), and one all-gather
    hands every rank every image's outputs, in order; its backward returns each image's gradient
    to the rank that encoded it. Only what the models read is whole: ``last_hidden_state``,
    ``pooler_output``, and the hidden states ``vision_feature_layer`` names (the other entries of
    ``hidden_states`` are None)."""
    if not tower.__dict__.get("_ulysses_share_images") or pixel_values is None or args:
        return type(tower).forward(tower, pixel_values, *args, **kwargs)
    group, timeout = tower.__dict__["_ulysses_group"], tower.__dict__.get("_ulysses_timeout")
    rank, size = G.rank_and_size(group)
    n = pixel_values.shape[0]
    if kwargs.get("image_sizes") is not None:  # (a list is split as a tensor)
        kwargs["image_sizes"] = torch.as_tensor(kwargs["image_sizes"], device=pixel_values.device)
    counts = even_split(n, size)
    begin = sum(counts[:rank])
    # A rank with no image encodes the first and keeps none of it: every trained tower parameter
    # takes part with a zero gradient (DDP and FSDP2 reduce the same parameters on every rank),
    # and the outputs' other dims come out as on the ranks that encode.
    first, count = (begin, counts[rank]) if counts[rank] else (0, 1)

    unknown = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in PER_IMAGE_KEYS)
    if unknown:  # (every rank of the group runs the same model on the same batch: raised alike)
        raise ValueError(f"ulysses.vision: {type(tower).__name__} was given {unknown}, which ulysses does not know "
                         f"how to share out with the images (it splits {list(PER_IMAGE_KEYS)})")
    out = type(tower).forward(tower, pixel_values.narrow(0, first, count),
                              **{k: v.narrow(0, first, count) if k in PER_IMAGE_KEYS and v is not None else v
                                 for k, v in kwargs.items()})
    names = [k for k in ("last_hidden_state", "pooler_output") if isinstance(getattr(out, k, None), torch.Tensor)]
    hidden: tuple = getattr(out, "hidden_states", None) or ()
    layers = sorted({i % len(hidden) for i in tower.__dict__["_ulysses_feature_layers"]}) if hidden else []
    parts = [getattr(out, k) for k in names] + [hidden[i] for i in layers]
    if type(tower).__name__ == "PixtralVisionModel":  # rows: tokens, each image's from its size
        tokens = (kwargs["image_sizes"] // tower.patch_size).prod(-1).tolist()
        rows = [sum(tokens[b:b + c]) for b, c in zip(itertools.accumulate([0] + counts), counts)]
        flat = [p.reshape(-1, p.shape[-1]) for p in parts]
        shapes = [(1, sum(tokens), p.shape[-1]) for p in parts]
    else:  # rows: images
        rows = counts
        flat = [p.reshape(count, -1) for p in parts]
        shapes = [(n, *p.shape[1:]) for p in parts]
    own = torch.cat(flat, dim=1).narrow(0, 0, rows[rank])
    whole = O.all_gather_sequence(own, 0, rows, group, timeout).split([f.shape[1] for f in flat], dim=1)
    gathered = [w.reshape(shape) for w, shape in zip(whole, shapes)]
    fields: dict = dict(zip(names, gathered[:len(names)]))
    if hidden:
        states: list = [None] * len(hidden)
        for i, g in zip(layers, gathered[len(names):]):
            states[i] = g
        fields["hidden_states"] = tuple(states)
    return type(out)(**fields)


def install(model: torch.nn.Module) -> None:
    """Binds the sharding language-model forward of a supported VLM, and its vision tower's
    forward that encodes each frame (ENCODED_ONCE) or image (IMAGES_ENCODED_ONCE) once per group."""
    text = language_model(model)
    text.forward = types.MethodType(_sharded_language_model, text)
    if type(model).__name__ in ENCODED_ONCE:
        visual: Any = getattr(model, "model", model).visual
        visual.forward = types.MethodType(_encoded_once, visual)
    elif type(model).__name__ in IMAGES_ENCODED_ONCE:
        tower = _image_tower(model)
        object.__setattr__(tower, "_ulysses_feature_layers", _feature_layers(model.config))
        tower.forward = types.MethodType(_images_encoded_once, tower)


def images_digest(kwargs: dict) -> list[float]:
    """The shapes and sums of a batch's pixel values, grids and packed positions: what every rank
    of a group must hold alike (compared in the batch's one agreement round, ``ulysses.hf``; a rank
    whose positions alone are wrong then fails with the others, not before their next collective)."""
    digest = []
    for name in IMAGE_KEYS:
        x = kwargs.get(name)
        if x is None:
            digest += [-1.0] * 4
            continue
        # Positions are also weighted by their place (a row's positions permuted differ); pixels
        # are summed in float64 without a float64 copy of them.
        flat = x.reshape(-1)
        place = (flat.double() * torch.arange(1, flat.numel() + 1, device=x.device)).sum().item() \
            if name == "position_ids" else 0.0
        digest += [float(x.dim()), float(flat.numel()), flat.sum(dtype=torch.float64).item(), place]
    return digest


#: The image towers' inputs with a row per image, which _images_encoded_once shares out with them.
PER_IMAGE_KEYS = ("image_sizes", "patch_attention_mask")
#: The inputs images_digest reads, named in its error.
IMAGE_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes",
              "pixel_attention_mask", "token_type_ids", "position_ids")


__all__ = ["BATCH_KEYS", "ENCODERS", "IMAGE_KEYS", "IMAGES_ENCODED_ONCE", "MODELS", "block_masks", "even_split",
           "frame_split", "image_blocks", "images_digest", "images_shared", "install", "is_vision_language",
           "language_model", "positions_problem", "text_positions"]
