"""Vision-language models (Qwen-VL, Gemma 3, the LLaVA family, Mistral 3, Idefics3, SmolVLM, InternVL)
under ulysses.hf on thread ranks: each image or frame is encoded once per group, every rank merges
the embeddings and makes the positions on the whole sequence, the language model runs on its
shard; loss and every parameter gradient (the vision tower's included) equal transformers' own
single-process model."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers
from transformers import AutoModelForImageTextToText

import ulysses.hf as uhf
from conftest import run_ranks, run_ranks_errors

IMAGE, VIDEO, VISION_START = 60, 61, 62
S, B = 23, 2  # S not divisible by 2 or 3
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                    "rope_theta": 10000.0})
VISION = dict(depth=2, num_heads=2)
LLAMA_TEXT = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
SMALL_TOWER = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=14)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START)
CONFIGS = {
    "qwen2_vl": lambda: transformers.Qwen2VLConfig(
        text_config=TEXT, vision_config=dict(embed_dim=16, hidden_size=32, mlp_ratio=2, **VISION), **TOKENS),
    # A window attention block and a full one in the vision tower.
    "qwen2_5_vl": lambda: transformers.Qwen2_5_VLConfig(
        text_config=TEXT, vision_config=dict(hidden_size=16, intermediate_size=32, out_hidden_size=32,
                                             fullatt_block_indexes=[1], window_size=56, **VISION), **TOKENS),
    # Deepstack: the tower's first block's features added to the first decoder layer's vision tokens.
    "qwen3_vl": lambda: transformers.Qwen3VLConfig(
        text_config=dict(TEXT, head_dim=8, rope_parameters=dict(TEXT["rope_parameters"], mrope_interleaved=True)),
        vision_config=dict(hidden_size=16, intermediate_size=32, out_hidden_size=32, deepstack_visual_indexes=[0],
                           patch_size=14, **VISION), **TOKENS),
    "qwen3_vl_moe": lambda: transformers.Qwen3VLMoeConfig(
        text_config=dict(TEXT, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         rope_parameters=dict(TEXT["rope_parameters"], mrope_interleaved=True)),
        vision_config=dict(hidden_size=16, intermediate_size=32, out_hidden_size=32, deepstack_visual_indexes=[0],
                           patch_size=14, **VISION), **TOKENS),
    # A CLIP tower of 28 x 28 images (4 patches: 4 image tokens each), a Llama language model
    # (1-D positions: each rank's shard gets its global positions).
    "llava": lambda: transformers.LlavaConfig(
        text_config=dict(model_type="llama", **LLAMA_TEXT),
        vision_config=dict(model_type="clip_vision_model", image_size=28, **SMALL_TOWER),
        image_token_index=IMAGE, vision_feature_layer=-1),
    # Pixtral's tower (56 x 56 images: 16 patches, merged 2 x 2), a Mistral language model.
    "mistral3": lambda: transformers.Mistral3Config(
        text_config=dict(model_type="mistral", **LLAMA_TEXT),
        vision_config=dict(model_type="pixtral", head_dim=8, image_size=56, **SMALL_TOWER),
        image_token_index=IMAGE, spatial_merge_size=2, vision_feature_layer=-1),
    # Tiled images (any-resolution: a 28 x 28 image is its base view and one tile, with a newline
    # token per row of the tile: 10 tokens), a Llama or a Qwen2 language model.
    "llava_next": lambda: transformers.LlavaNextConfig(
        text_config=dict(model_type="llama", **LLAMA_TEXT), vision_config=dict(model_type="clip_vision_model",
                                                                              image_size=28, **SMALL_TOWER),
        image_token_index=IMAGE, vision_feature_layer=-1, image_grid_pinpoints=[[28, 28]]),
    "llava_onevision": lambda: transformers.LlavaOnevisionConfig(
        text_config=dict(model_type="qwen2", **LLAMA_TEXT), vision_config=dict(model_type="siglip_vision_model",
                                                                              image_size=28, **SMALL_TOWER),
        image_token_index=IMAGE, video_token_index=VIDEO, vision_feature_layer=-1, image_grid_pinpoints=[[28, 28]]),
    # Videos too: each frame pooled to one token (OneVision adds a newline token per video).
    "llava_next_video": lambda: transformers.LlavaNextVideoConfig(
        text_config=dict(model_type="llama", **LLAMA_TEXT), vision_config=dict(model_type="clip_vision_model",
                                                                              image_size=28, **SMALL_TOWER),
        image_token_index=IMAGE, video_token_index=VIDEO, vision_feature_layer=-1, image_grid_pinpoints=[[28, 28]],
        spatial_pool_stride=2),
    # Idefics3's tower and pixel-shuffle connector (56 x 56 images, scale 2: 4 tokens), its
    # language model under ``text_model``; InternVL's likewise (downsample 0.5).
    "idefics3": lambda: transformers.Idefics3Config(
        text_config=dict(model_type="llama", **LLAMA_TEXT), vision_config=dict(image_size=56, **SMALL_TOWER),
        image_token_id=IMAGE, scale_factor=2),
    "smolvlm": lambda: transformers.SmolVLMConfig(
        text_config=dict(model_type="llama", **LLAMA_TEXT), vision_config=dict(image_size=56, **SMALL_TOWER),
        image_token_id=IMAGE, scale_factor=2),
    "internvl": lambda: transformers.InternVLConfig(
        text_config=dict(model_type="qwen2", **LLAMA_TEXT),
        vision_config=dict(SMALL_TOWER, image_size=[56, 56], patch_size=[14, 14]),
        image_token_id=IMAGE, downsample_ratio=0.5, vision_feature_layer=-1),
    # Gemma 3: an image's 4 tokens see each other both ways (token_type_ids); a sliding layer of
    # window 3 (shorter than an image) and a full one.
    "gemma3": lambda: transformers.Gemma3Config(
        text_config=dict(LLAMA_TEXT, head_dim=8, sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(image_size=28, **SMALL_TOWER), mm_tokens_per_image=4, image_token_id=IMAGE),
}
#: The families whose images are each a run of image tokens (no grids, 1-D positions): how many
#: tokens an image makes, and its pixel inputs for n images over the B rows.
TOKENS_PER_IMAGE = {"llava": 4, "mistral3": 4, "llava_next": 10, "llava_onevision": 10, "llava_next_video": 10,
                    "idefics3": 4, "smolvlm": 4, "internvl": 4, "gemma3": 4}
#: Those that take videos too: the frames of a video of 8 tokens ([B, frames, 3, 28, 28]).
VIDEO_FRAMES = {"llava_onevision": 7, "llava_next_video": 8}


def image_pixels(name: str, n: int, gen: torch.Generator) -> dict:
    if name in ("llava", "gemma3"):
        return {"pixel_values": torch.randn(n, 3, 28, 28, generator=gen)}
    if name == "mistral3":
        return {"pixel_values": torch.randn(n, 3, 56, 56, generator=gen), "image_sizes": torch.tensor([[56, 56]] * n)}
    if name in ("llava_next", "llava_onevision", "llava_next_video"):  # the base view and one tile
        return {"pixel_values": torch.randn(n, 2, 3, 28, 28, generator=gen),
                "image_sizes": torch.tensor([[28, 28]] * n)}
    if name in ("idefics3", "smolvlm"):  # [B, images per row, ...]
        return {"pixel_values": torch.randn(B, n // B, 3, 56, 56, generator=gen),
                "pixel_attention_mask": torch.ones(B, n // B, 56, 56, dtype=torch.bool)}
    return {"pixel_values": torch.randn(n, 3, 56, 56, generator=gen)}  # internvl


PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(CONFIGS[name](), attn_implementation="eager").float()


def make_image_batch(name: str, kind: str, start: int) -> dict:
    """make_batch's rows for the families of TOKENS_PER_IMAGE: each image a run of its tokens
    (the second of "images" after the first where they would overlap), no grids or videos."""
    batch = make_batch(kind, start, TOKENS_PER_IMAGE[name])
    for key in ("input_ids", "labels"):
        batch[key] = batch[key].masked_fill(batch[key] == VISION_START, 1)
    batch.pop("mm_token_type_ids")
    gen = torch.Generator().manual_seed(2)
    if "image_grid_thw" in batch:
        images = batch.pop("image_grid_thw").shape[0]
        del batch["pixel_values"]
        batch.update(image_pixels(name, images, gen))
    if name == "gemma3":
        batch["token_type_ids"] = (batch["input_ids"] == IMAGE).long()
    if "video_grid_thw" in batch:  # a video per row
        del batch["video_grid_thw"]
        batch["pixel_values_videos"] = torch.randn(B, VIDEO_FRAMES[name], 3, 28, 28, generator=gen)
    return batch


def make_batch(kind: str, start: int, image_tokens: int = 4) -> dict:
    """Two rows, row 1 right-padded by 3: one image of ``image_tokens`` per row from token
    ``start`` (4: a 4x4 patch grid, merged 2x2), or a video of 8 tokens (two temporal steps), or
    both (the image at 1), or two images (at 1 and at ``start``, or after the first), or
    "frames": the same video as Qwen3-VL's processor lays it out, each temporal step its own run
    of 4 tokens after a timestamp token and a vision start (at ``start`` and ``start + 6``)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, IMAGE - 1, (B, S), generator=gen)
    batch: dict = {}
    t = image_tokens
    spans = {"image": [(IMAGE, start, t)], "video": [(VIDEO, start, 8)],
             "both": [(IMAGE, 1, t), (VIDEO, max(start, t + 2), 8)],
             "images": [(IMAGE, 1, t), (IMAGE, max(start, t + 2), t)],
             "frames": [(VIDEO, start, 4), (VIDEO, start + 6, 4)]}[kind]
    for token, at, count in spans:
        ids[:, at - 1] = VISION_START
        ids[:, at:at + count] = token
    if kind in ("image", "both", "images"):
        images = B * (2 if kind == "images" else 1)
        batch["pixel_values"] = torch.randn(images * 16, PATCH, generator=gen)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * images)
    if kind in ("video", "both", "frames"):
        batch["pixel_values_videos"] = torch.randn(B * 32, PATCH, generator=gen)
        batch["video_grid_thw"] = torch.tensor([[2, 4, 4]] * B)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0
    batch.update(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                 mm_token_type_ids=(ids == IMAGE).long() + 2 * (ids == VIDEO).long())
    return batch


def reference(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out.loss.item(), _gradients(model)


def sharded_step(model, batch, group, give_seq_lens=True, tiled=False):
    """One step of the whole batch on every rank; ``tiled``: scored by the tiled loss, no logits."""
    sb = uhf.shard_batch({k: batch[k] for k in ("input_ids", "labels", "attention_mask") if k in batch}, group)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if give_seq_lens:
        inputs["ulysses_seq_lens"] = sb["seq_lens"]
    if tiled:
        inputs["ulysses_shift_labels"] = sb["shift_labels"]
    out = model(**inputs)  # the whole batch on every rank
    if tiled:
        assert out.logits is None
        loss, global_loss = uhf.token_mean(out.loss, sb["shift_labels"], group)
    else:
        loss, global_loss = uhf.sequence_parallel_loss(out.logits, sb["shift_labels"], group)
    loss.backward()
    uhf.all_reduce_gradients(model, group)
    return global_loss.item(), _gradients(model)


def assert_matches(got, want):
    """Loss and every gradient to 1e-5 relative, as test_hf's; but a key projection's bias, whose
    gradient is zero in exact arithmetic (softmax ignores a shift of every score), is rounding on
    both sides: held to 1e-6 of the model's largest gradient instead."""
    loss, grads = got
    ref_loss, ref_grads = want
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    largest = max(g.abs().max() for g in ref_grads.values())
    for name, g in ref_grads.items():
        scale = largest if name.endswith("k_proj.bias") else g.abs().max().clamp_min(1e-12)
        err = (grads[name] - g).abs().max() / scale
        assert err <= (1e-6 if name.endswith("k_proj.bias") else 1e-5), (name, err.item())


def _gradients(model) -> dict:
    """Every parameter's gradient; zeros for one nothing used (CLIP's last norm under LLaVA)."""
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


# start 10 at P = 2 and 7 at P = 3: the image or video straddles a shard boundary (12 | 11;
# 8 | 8 | 7); start 2 at P = 3: rank 2's shard holds no vision token. "both": an image at 1..4
# and a video from start.
CASES = [(kind, P, start) for kind in ("image", "video") for P, start in ((2, 10), (3, 7), (3, 2))]
CASES += [("both", 2, 10), ("both", 3, 7), ("images", 2, 10), ("images", 3, 7)]
# Qwen3-VL's videos: frames apart, each after its timestamp (the first frame straddles 12 | 11
# at P = 2; at P = 3 from 7 both frames straddle 8 | 8 | 7; from 2 rank 2 holds no vision token).
FRAMES = [("frames", 2, 10), ("frames", 3, 7), ("frames", 3, 2)]


def _cases(name: str) -> list:
    if name in VIDEO_FRAMES:
        return CASES
    if name in TOKENS_PER_IMAGE:  # no video
        return [c for c in CASES if c[0] in ("image", "images")]
    if name.startswith("qwen3_vl"):  # videos as frames apart (timestamps between)
        return [c for c in CASES if c[0] in ("image", "images")] + FRAMES
    return CASES


@pytest.mark.parametrize("name,kind,P,start", [(name, *case) for name in CONFIGS for case in _cases(name)])
def test_loss_and_every_gradient_equal_the_unsharded_model(name, kind, P, start):
    base = make_model(name)
    batch = make_image_batch(name, kind, start) if name in TOKENS_PER_IMAGE else make_batch(kind, start)
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(P)]

    def body(rank, group):
        return sharded_step(uhf.sequence_parallel(models[rank], group), batch, group)

    for got in run_ranks(P, body):
        assert_matches(got, want)


def _first_row(batch: dict) -> dict:
    """``batch``'s first row alone, with its one image: the grid families' first 16 patches and
    grid row; the others' first image (Idefics3's and SmolVLM's [1, n, ...])."""
    row = {k: v[:1] for k, v in batch.items() if k not in ("pixel_values", "image_grid_thw")}
    if "image_grid_thw" in batch:
        row["image_grid_thw"] = batch["image_grid_thw"][:1]
        row["pixel_values"] = batch["pixel_values"][:int(batch["image_grid_thw"][0].prod())]
    else:
        row.update({k: batch[k][:1] for k in ("pixel_values", "image_sizes", "pixel_attention_mask") if k in batch})
    return row


def _autocast(dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name,P,images", [(name, P, n) for name in CONFIGS for P, n in ((3, 1), (4, 2))])
def test_ranks_without_an_image_run_exact_under_autocast(name, P, images, dtype):
    """One image at P = 3 and two at P = 4: some ranks encode no frame (the grid families) or
    the first image again (the others), under CPU bf16 autocast too, where the frames a rank
    encodes come out in bf16: an idle rank's empty shard must come in the same dtype, or the
    gather fails every rank (it once came in fp32). fp32: exact; bf16: the unsharded model under
    the same autocast, to bf16's rounding."""
    base = make_model(name)
    whole = make_image_batch(name, "image", 7) if name in TOKENS_PER_IMAGE else make_batch("image", 7)
    batch = _first_row(whole) if images == 1 else whole
    with _autocast(dtype):
        want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(P)]

    def body(rank, group):
        with _autocast(dtype):
            return sharded_step(uhf.sequence_parallel(models[rank], group), batch, group)

    for got in run_ranks(P, body):
        if dtype == "fp32":
            assert_matches(got, want)
        else:
            loss, grads = got
            assert abs(loss - want[0]) <= 2e-2 * abs(want[0]), (loss, want[0])
            largest = max(g.abs().max() for g in want[1].values())
            worst = max(((grads[n] - g).abs().max() / largest).item() for n, g in want[1].items())
            assert worst <= 5e-2, worst


def test_the_vision_tower_keeps_its_own_attention():
    model = uhf.sequence_parallel(make_model("qwen2_5_vl"), "")
    assert model.config.vision_config._attn_implementation == "eager"
    assert model.config.text_config._attn_implementation == "ulysses"
    with uhf.unsharded(model):
        assert model.config.text_config._attn_implementation == "eager"
    assert model.config.vision_config._attn_implementation == "eager"
    assert model.config.text_config._attn_implementation == "ulysses"


@pytest.mark.parametrize("change", ["grid", "pixels", "positions shape", "positions"])
def test_one_rank_given_other_images_fails_alike(change):
    """One rank's images, grids or packed positions other than the rest fail every rank alike in
    the batch's one round (a rank raising alone would leave the others waiting to a timeout)."""
    base = make_model("qwen2_5_vl")
    models = [copy.deepcopy(base) for _ in range(2)]
    batch = make_packed_batch("qwen2_5_vl")

    def body(rank, group):
        mine = dict(batch)
        if rank == 1 and change == "grid":  # the same patches, another grid (2 x 8)
            mine["image_grid_thw"] = torch.tensor([[1, 2, 8]] * 2)
        elif rank == 1 and change == "pixels":
            mine["pixel_values"] = batch["pixel_values"] + 1
        elif rank == 1 and change == "positions shape":  # text positions alone: refused on this rank
            mine["position_ids"] = batch["position_ids"][0]
        elif rank == 1:  # the two documents' positions swapped: the same values, other places
            mine["position_ids"] = batch["position_ids"].roll(5, dims=-1)
        sharded_step(uhf.sequence_parallel(models[rank], group), mine, group)

    errors = run_ranks_errors(2, body)
    assert errors[0] == errors[1] and "rank(s) [1] hold other images, grids or positions than rank 0" in errors[0], \
        errors


def test_an_image_tower_input_it_cannot_share_out_is_refused():
    """The tower encoding each image once splits the per-image inputs it knows by name; another
    tensor is refused with what it splits, not guessed to be per image from its length."""
    from ulysses import vision
    model = uhf.sequence_parallel(make_model("llava"), "")
    tower = model.model.vision_tower
    pixels = torch.randn(2, 3, 28, 28)
    with vision.images_shared(model):
        assert tower(pixels).last_hidden_state.shape[0] == 2  # (image_sizes and the rest: the matrix)
        with pytest.raises(ValueError, match=r"was given \['bogus'\], which ulysses does not know how to share"):
            tower(pixels, bogus=torch.zeros(2))


def test_labels_given_to_the_model_are_refused_with_what_to_do():
    model = uhf.sequence_parallel(make_model("qwen2_vl"), "")
    with pytest.raises(ValueError, match="give labels to shard_batch and score its shift_labels"):
        model(**make_batch("image", 10))


def test_verify_takes_a_vision_language_model():
    base = make_model("qwen2_5_vl")
    models = [copy.deepcopy(base) for _ in range(2)]
    batch = make_batch("both", 10)

    def body(rank, group):
        result = uhf.verify(uhf.sequence_parallel(models[rank], group), batch, group, tolerance=1e-5)
        return result.worst, sorted(n for n in result.gradient_errors if ".visual." in n)

    (worst, tower), (worst_1, _) = run_ranks(2, body)
    assert worst == worst_1 and worst[1] <= 1e-5
    assert tower  # the vision tower's gradients are among those checked


def test_the_vision_example_verifies_and_trains():
    from conftest import run_example

    r = run_example("hf_vision.py", 2, "--steps", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "verify: loss relative error" in r.stdout and "step 2/2 loss" in r.stdout, r.stdout


@pytest.mark.parametrize("name,kind", [("qwen2_5_vl", "both"), ("qwen3_vl", "frames")])
def test_each_frame_is_encoded_once_per_group(name, kind):
    """At P = 2 the vision tower of each rank sees its own frames only (an image is one frame, a
    video of two temporal steps two), together every patch once; the gradients above equal the
    single-process model's, so the exchange of the embeddings (and of Qwen3-VL's deepstack
    features with them) and its backward are exact."""
    base = make_model(name)
    batch = make_batch(kind, 10)
    models = [copy.deepcopy(base) for _ in range(2)]
    total = sum(batch[k].shape[0] for k in ("pixel_values", "pixel_values_videos") if k in batch)

    def body(rank, group):
        seen = []
        model = uhf.sequence_parallel(models[rank], group)
        model.model.visual.patch_embed.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
        sharded_step(model, batch, group)
        return sum(seen)

    rows = run_ranks(2, body)
    assert sum(rows) == total and max(rows) < total, rows


@pytest.mark.parametrize("name,P", [("llava_next_video", 2), ("gemma3", 3), ("internvl", 2), ("idefics3", 3),
                                    ("mistral3", 2)])
def test_each_image_is_encoded_once_per_group(name, P):
    """The towers that encode images one by one (CLIP, SigLIP, InternViT, Idefics3's, Pixtral) see
    an even share of the batch's images on each rank (LLaVA-NeXT-Video: its tiles, then its video
    frames);
    at P = 3 with 4 images one rank encodes one; the matrix above holds the gradients exact."""
    base = make_model(name)
    batch = make_image_batch(name, "both" if name in VIDEO_FRAMES else "images", 10)
    models = [copy.deepcopy(base) for _ in range(P)]

    def body(rank, group):
        seen = []
        model = uhf.sequence_parallel(models[rank], group)
        tower = model.model.vision_model if name == "idefics3" else model.model.vision_tower
        patches = next(m for m in tower.modules() if isinstance(m, torch.nn.Conv2d))  # sees the images
        patches.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
        sharded_step(model, batch, group)
        return seen

    seen = run_ranks(P, body)
    if name == "llava_next_video":  # 2 images of 2 tiles; 2 videos of 8 frames
        assert seen == [[2, 8], [2, 8]], seen
    else:  # 4 images
        assert [sum(s) for s in seen] == ([2, 2] if P == 2 else [2, 1, 1]), seen


@pytest.mark.parametrize("layer", [-2, [0, -1]])
def test_llava_reading_inner_tower_layers_is_exact(layer):
    """LLaVA's default reads the tower's next-to-last hidden state (or several, concatenated):
    those are what the encoded-once tower gathers, besides its last; at P = 3 one rank of three
    encodes no image (two images)."""
    torch.manual_seed(0)
    config = CONFIGS["llava"]()
    config.vision_feature_layer = layer
    base = AutoModelForImageTextToText.from_config(config, attn_implementation="eager").float()
    batch = make_image_batch("llava", "image", 7)
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(3)]
    for got in run_ranks(3, lambda rank, group: sharded_step(uhf.sequence_parallel(models[rank], group), batch, group)):
        assert_matches(got, want)


def test_frame_split_balances_patches_and_keeps_order():
    from ulysses.vision import frame_split

    grid = torch.tensor([[1, 4, 4], [4, 2, 2], [1, 2, 2]])  # an image of 16 patches, a 4-frame video, an image
    runs = frame_split(grid, 3)
    # Each frame goes where its first patch falls in thirds of the 36 patches (16 | 8 | 12).
    assert runs == [[(0, 0, 1, 16)], [(1, 0, 2, 4)], [(1, 2, 2, 4), (2, 0, 1, 4)]], runs
    assert frame_split(torch.tensor([[8, 2, 2]]), 2) == [[(0, 0, 4, 4)], [(0, 4, 4, 4)]]  # a video cut by frames
    assert frame_split(torch.tensor([[1, 2, 2]]), 3) == [[(0, 0, 1, 4)], [], []]  # more ranks than frames


@pytest.mark.parametrize("P", [2, 3])
def test_a_forward_without_seq_lens_takes_shard_batchs_split(P):
    """Without ulysses_seq_lens the forward splits the sequence by shard_batch's rule (it used to
    take the rule's (begin, end) pairs for lengths)."""
    base = make_model("qwen2_5_vl")
    batch = make_batch("image", 7)
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(P)]

    def body(rank, group):
        return sharded_step(uhf.sequence_parallel(models[rank], group), batch, group, give_seq_lens=False)

    for got in run_ranks(P, body):
        assert_matches(got, want)


@pytest.mark.parametrize("token_types", ["none", "all text"])
def test_gemma3_without_image_blocks_attends_causally(token_types):
    """Gemma 3 given no token_type_ids (or no image token among them) makes causal masks only, as
    transformers' own model does: no dense mask then, the padding mask narrowed to the shard."""
    base = make_model("gemma3")
    batch = make_image_batch("gemma3", "images", 7)
    if token_types == "none":
        del batch["token_type_ids"]
    else:
        batch["token_type_ids"] = torch.zeros_like(batch["token_type_ids"])
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(3)]
    for got in run_ranks(3, lambda rank, group: sharded_step(uhf.sequence_parallel(models[rank], group), batch, group)):
        assert_matches(got, want)


def make_packed_batch(name: str) -> dict:
    """One row of two documents (9 and 14 tokens), an image in each (the second's at 10..13,
    straddling the 12 | 11 split at P = 2), position ids restarting at the second: Qwen-VL's
    ``[4, 1, S]`` (the text positions, then each document's own mrope positions), the others'
    ``[1, S]``. No padding mask (packed rows have none); each document's first label unscored (no
    target across documents)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, IMAGE - 1, (1, S), generator=gen)
    starts, images = [0, 9], [(2, 4), (10, 4)]
    for at, count in images:
        ids[0, at - 1] = VISION_START if name.startswith("qwen") else 1
        ids[0, at:at + count] = IMAGE
    text = torch.cat([torch.arange(9), torch.arange(S - 9)])[None]
    labels = ids.clone()
    labels[0, starts] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": text}
    if name.startswith("qwen"):
        batch["pixel_values"] = torch.randn(2 * 16, PATCH, generator=gen)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * 2)
        batch["mm_token_type_ids"] = (ids == IMAGE).long()
        rope = make_model(name).model.get_rope_index
        mrope = [rope(input_ids=ids[:, a:b], mm_token_type_ids=batch["mm_token_type_ids"][:, a:b],
                      image_grid_thw=batch["image_grid_thw"][i:i + 1])[0] for i, (a, b) in enumerate([(0, 9), (9, S)])]
        batch["position_ids"] = torch.cat([text[None], torch.cat(mrope, dim=2)])
    else:
        batch.update(image_pixels(name, 2, gen))
        if name == "gemma3":
            batch["token_type_ids"] = (ids == IMAGE).long()
    return batch


def separate_reference(model, batch):
    """make_packed_batch's documents each run on its own through the single-process model (what
    packing stands for: transformers' VLMs do not keep packed documents apart themselves), the
    loss over both documents' targets, and every gradient."""
    model.zero_grad()
    logits = []
    for doc, (begin, end) in enumerate([(0, 9), (9, S)]):
        inputs = {"input_ids": batch["input_ids"][:, begin:end]}
        for key in ("pixel_values", "image_sizes", "token_type_ids", "mm_token_type_ids"):
            if key in batch:
                per_token = key.endswith("type_ids")
                inputs[key] = batch[key][:, begin:end] if per_token else batch[key].chunk(2)[doc]
        if "image_grid_thw" in batch:
            inputs["image_grid_thw"] = batch["image_grid_thw"][doc:doc + 1]
        logits.append(model(**inputs).logits)
    loss = torch.nn.functional.cross_entropy(torch.cat(logits, 1)[0, :-1], batch["labels"][0, 1:])
    loss.backward()
    return loss.item(), _gradients(model)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "internvl", "mistral3", "gemma3"])
@pytest.mark.parametrize("P", [2, 3])
def test_packed_rows_are_exact(name, P):
    """Packed rows: the documents' positions restart, and the attention keeps each document to
    itself (from those positions, as for text models): as if each document ran on its own."""
    base = make_model(name)
    batch = make_packed_batch(name)
    want = separate_reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base) for _ in range(P)]

    for got in run_ranks(P, lambda rank, group: sharded_step(uhf.sequence_parallel(models[rank], group), batch, group)):
        assert_matches(got, want)


def test_packed_positions_of_the_wrong_shape_are_refused_with_what_to_give():
    """The Trainer refuses these alike on every rank (its batch-keys round): a Qwen-VL row needs
    its mrope positions per document, which [B, S] cannot carry; the others take [B, S]."""
    from ulysses.vision import positions_problem

    qwen, llava = make_model("qwen2_5_vl"), make_model("llava")
    flat, four = torch.arange(S)[None], torch.zeros(4, 1, S, dtype=torch.long)
    assert "packed rows carry position_ids [4, B, S]" in positions_problem(qwen, flat)
    assert positions_problem(qwen, four) == positions_problem(llava, flat) == positions_problem(llava, None) == ""
    assert "carry position_ids [B, S], restarting at each document" in positions_problem(llava, four)


@pytest.mark.parametrize("name,P", [("qwen2_5_vl", 2), ("gemma3", 3), ("llava_next_video", 2)])
def test_the_tiled_loss_and_every_long_sequence_feature_are_exact(name, P):
    """The whole batch on every rank, this rank's shard scored in tiles from the base model's
    hidden states (no logits), with tiled MLPs (the language model's) and offloaded checkpoints
    (the tower's layers too), equal the single-process model. Gemma 3's VLM head applies no final
    softcap, even with one in its text config (only Gemma3ForCausalLM does): neither does the
    tiled loss, which follows the model's own config."""
    base = make_model(name)
    batch = make_image_batch(name, "both" if name in VIDEO_FRAMES else "images", 7) if name in TOKENS_PER_IMAGE \
        else make_batch("both", 10)
    if name == "gemma3":
        base.config.text_config.final_logit_softcapping = 3.0
    want = reference(copy.deepcopy(base), batch)
    models = [copy.deepcopy(base).train() for _ in range(P)]

    def body(rank, group):
        model = uhf.sequence_parallel(models[rank], group, tiled_mlp=True, tiled_loss=True, checkpoint="offload",
                                      mlp_tile_tokens=2, loss_tile_bytes=4 * 64 * 3)
        return sharded_step(model, batch, group, tiled=True)

    for got in run_ranks(P, body):
        assert_matches(got, want)
