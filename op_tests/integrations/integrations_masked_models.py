"""Tiny, randomly initialised diffusers transformers that send key-padding masks on every
attention call — HunyuanVideo, QwenImage, LTX — with padded prompts (nothing is downloaded).

The configurations are diffusers' own test configurations (tests/models/transformers), with
the head dims made multiples of 8 (the kernels' rule; HunyuanVideo's test uses 10) and a batch
of two prompts padded to one length with different real lengths. Used by
test_integrations_masked_models.py.
"""

from __future__ import annotations

import torch

TEXT = 12  # text tokens per prompt (padded)
REAL = (12, 5)  # real text tokens of the two prompts


def _text_mask(dtype=torch.bool):
    m = torch.zeros(len(REAL), TEXT, dtype=torch.bool)
    for i, n in enumerate(REAL):
        m[i, :n] = True
    return m.to(dtype)


def hunyuan_video(seed=0, dtype=torch.bfloat16):
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6),
    )
    g = torch.Generator().manual_seed(seed + 1)
    b = len(REAL)
    inputs = dict(
        hidden_states=torch.randn(b, 4, 1, 8, 8, generator=g).to(dtype),
        timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(b, TEXT, 16, generator=g).to(dtype),
        pooled_projections=torch.randn(b, 8, generator=g).to(dtype),
        encoder_attention_mask=_text_mask(torch.long),
        guidance=torch.tensor([3000.0, 3000.0]).to(dtype),
        return_dict=False,
    )
    return model.to(dtype).eval(), inputs


def qwen_image(seed=0, dtype=torch.bfloat16):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    g = torch.Generator().manual_seed(seed + 1)
    b, h, w = len(REAL), 8, 8
    inputs = dict(
        hidden_states=torch.randn(b, h * w, 16, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(b, TEXT, 16, generator=g).to(dtype),
        encoder_hidden_states_mask=_text_mask(),
        timestep=torch.tensor([1.0, 1.0]).to(dtype),
        img_shapes=[(1, h, w)] * b,
        return_dict=False,
    )
    return model.to(dtype).eval(), inputs


def ltx(seed=0, dtype=torch.bfloat16):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    model = LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        qk_norm="rms_norm_across_heads",
        caption_channels=16,
    )
    g = torch.Generator().manual_seed(seed + 1)
    b, frames, h, w = len(REAL), 2, 8, 8
    inputs = dict(
        hidden_states=torch.randn(b, frames * h * w, 4, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(b, TEXT, 16, generator=g).to(dtype),
        timestep=torch.tensor([500, 500]),
        encoder_attention_mask=_text_mask(torch.long),
        num_frames=frames,
        height=h,
        width=w,
        return_dict=False,
    )
    return model.to(dtype).eval(), inputs


MODELS = {"hunyuan_video": hunyuan_video, "qwen_image": qwen_image, "ltx": ltx}


def run(name: str, backend: str):
    model, inputs = MODELS[name]()
    model.set_attention_backend(backend)
    with torch.no_grad():
        return model(**inputs)[0]
