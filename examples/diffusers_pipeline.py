"""A diffusers pipeline with aiter_sage's SageAttention as the transformer's attention backend.

    python3 examples/diffusers_pipeline.py                       # FLUX.1-schnell, 4 steps
    python3 examples/diffusers_pipeline.py --backend native      # the same with torch SDPA
    python3 examples/diffusers_pipeline.py --model Qwen/Qwen-Image --steps 20

The first run downloads the model from the Hugging Face Hub (FLUX.1-schnell: about 34 GB; it
may need `huggingface-cli login` and the licence accepted on its page). On an RDNA4 GPU
(gfx1201/gfx1200, ROCm PyTorch) the attention runs the gfx12 kernels; without one it runs
aiter_sage's cpu backend (slow for a full image model: use it to check the setup, with
--size 256 --steps 1).
"""

import argparse
import time

import torch
from diffusers import DiffusionPipeline, attention_backend

import aiter_sage.integrations.diffusers  # noqa: F401  (registers the "aiter_sage" backend)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="black-forest-labs/FLUX.1-schnell")
    ap.add_argument("--prompt", default="a lighthouse on a cliff at dusk, oil painting")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=1024, help="image height and width")
    ap.add_argument("--backend", default="aiter_sage", help='"aiter_sage" or "native"')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", default="out.png")
    a = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = DiffusionPipeline.from_pretrained(a.model, torch_dtype=torch.bfloat16).to(device)

    # Either set it on the model for good ...
    pipe.transformer.set_attention_backend(a.backend)
    # ... or for a block of code (the active backend, for models where none is set):
    with attention_backend(a.backend), torch.inference_mode():
        t0 = time.perf_counter()
        image = pipe(
            a.prompt,
            num_inference_steps=a.steps,
            height=a.size,
            width=a.size,
            generator=torch.Generator(device).manual_seed(a.seed),
        ).images[0]
    print(f"{a.backend}: {time.perf_counter() - t0:.1f} s for {a.steps} steps -> {a.output}")
    image.save(a.output)


if __name__ == "__main__":
    main()
