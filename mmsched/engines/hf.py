"""``mmsched.engines.hf:HFEngine``: a transformers LLaVA (CLIP vision tower, Llama language
model) behind mmsched, greedy ``generate`` and mean-pooled ``embed``.

Every rank holds the whole trunk and runs it on the same inputs; the LM head is split by
vocabulary rows, each rank scores its slice, and one all-gather on the engine's group
makes the next-token choice, so tp=1 and tp=N pick the same tokens. Weights: a directory
holding safetensors/bin files loads with ``from_pretrained``; a directory with only a
config (configs/hf-tiny) gets seeded random weights, the same on every rank.
"""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError

# The tiny model's files: configs/hf-tiny in a checkout; the image copies them to /etc/mmsched.
SHIPPED = next((p for p in (Path(__file__).resolve().parents[2] / "configs" / "hf-tiny", Path("/etc/mmsched/hf-tiny"))
                if p.is_dir()), Path("configs/hf-tiny"))


def load_model(model_dir: str, seed: int):
    """``from_pretrained(model_dir)`` when it holds weights, else seeded weights from its config."""
    from transformers import AutoConfig, LlavaForConditionalGeneration

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ConfigError(f"engine_options.model: {model_dir!r} has no config.json")
    if glob.glob(os.path.join(model_dir, "*.safetensors")) or glob.glob(os.path.join(model_dir, "*.bin")):
        model = LlavaForConditionalGeneration.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    else:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = LlavaForConditionalGeneration(config)
    return model.eval()


class HFEngine:
    """The contract's engine: ``HFEngine(ctx)``; options: ``model`` (a local directory)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.model = load_model(str(ctx.options.get("model", SHIPPED)), ctx.seed)
        cfg = self.model.config
        self.image_token, self.eos = cfg.image_token_index, cfg.text_config.eos_token_id
        self.vocab, self.context = cfg.text_config.vocab_size, cfg.text_config.max_position_embeddings
        size = cfg.vision_config.image_size
        self.pixel_shape = (cfg.vision_config.num_channels, size, size)
        self.tokens_per_image = (size // cfg.vision_config.patch_size) ** 2
        rows = torch.tensor_split(self.model.lm_head.weight.detach(), ctx.world, dim=0)
        self.head = rows[ctx.rank].contiguous()  # this rank's vocabulary slice
        self.widths = [r.shape[0] for r in rows]

    def step(self, requests) -> list:
        t0, outputs = time.perf_counter(), []
        for req in requests:
            try:  # deterministic checks, before any collective: every rank refuses the same requests
                ids, pixels = self._inputs(req)
            except ValueError as exc:
                outputs.append(exc)
                continue
            with torch.inference_mode():
                outputs.append(self._embed(ids, pixels) if req.type == "embed"
                               else self._generate(ids, pixels, req.max_new_tokens))
        step_s = round(time.perf_counter() - t0, 6)  # the batch's whole step: the worker's timing split
        return [o if isinstance(o, Exception) else dict(o, engine_s=step_s) for o in outputs]

    def _inputs(self, req) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.from_numpy(np.asarray(req.input_ids, dtype=np.int64)).reshape(1, -1)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab:
            raise ValueError(f"input_ids outside the vocabulary (0..{self.vocab - 1})")
        wanted = ids.shape[1] + (req.max_new_tokens if req.type == "generate" else 0)
        if wanted > self.context:  # past it the positions are garbage, and the run takes minutes
            raise ValueError(f"{ids.shape[1]} input ids + {wanted - ids.shape[1]} new tokens are over the "
                             f"model's context of {self.context} (max_position_embeddings)")
        pixels = [f.to(torch.float32).reshape(-1, *self.pixel_shape) for f in self._checked(req.features)]
        images = sum(p.shape[0] for p in pixels)
        slots = int((ids == self.image_token).sum())
        if slots != images * self.tokens_per_image:
            raise ValueError(f"{slots} image tokens for {images} image(s); each takes {self.tokens_per_image}")
        return ids, (torch.cat(pixels) if pixels else None)

    def _checked(self, features):
        per_image = int(np.prod(self.pixel_shape))
        for f in features:
            if not f.is_floating_point() or f.numel() == 0 or f.numel() % per_image:
                raise ValueError(f"a feature of {f.dtype} {tuple(f.shape)} is not pixel values "
                                 f"(float, N x {' x '.join(map(str, self.pixel_shape))})")
            yield f

    def _embed(self, ids, pixels) -> dict:
        h = self.model.model(input_ids=ids, pixel_values=pixels).last_hidden_state[0].mean(dim=0)
        v = (h / h.norm().clamp_min(1e-12)).numpy().astype("<f4")
        return {"embedding": v.tobytes(), "dim": int(v.size)}

    def _generate(self, ids, pixels, max_new_tokens: int) -> dict:
        out = self.model.model(input_ids=ids, pixel_values=pixels, use_cache=True)
        tokens: list[int] = []
        while len(tokens) < max_new_tokens:
            tokens.append(self._next_token(out.last_hidden_state[0, -1]))
            if tokens[-1] == self.eos:
                break
            out = self.model.model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        return {"output_ids": tokens}

    def _next_token(self, h: torch.Tensor) -> int:
        """Greedy over the sharded head: each rank scores its rows, one all-gather joins them."""
        local = self.head @ h
        if self.ctx.group is None:
            return int(torch.argmax(local))
        import torch.distributed as dist

        padded = torch.full((max(self.widths),), float("-inf"))
        padded[: local.shape[0]] = local
        gathered = torch.empty(self.ctx.world * padded.shape[0])
        _all_gather_single(gathered, padded, group=self.ctx.group)
        gathered = gathered.view(self.ctx.world, -1)
        return int(torch.argmax(torch.cat([gathered[r, :w] for r, w in enumerate(self.widths)])))


def _all_gather_single(out, t, group):
    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t, group=group)
