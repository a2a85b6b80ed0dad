"""Flow-matching Euler sampling pieces: shifted sigmas, the step, CFG, initial noise."""

from __future__ import annotations

import torch

from ditkv.errors import ConfigError
from ditkv.models.hunyuan.config import HunyuanImage3Config


def flow_sigmas(steps: int, shift: float) -> torch.Tensor:
    """Shifted noise levels [steps + 1], from 1 down to 0 (fp32).

    sigma = linspace(1, 0, steps+1); sigma' = s*sigma / (1 + (s-1)*sigma). A shift s > 1
    spends more steps at high noise. Computed in fp64, returned in fp32.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError("steps", steps, "must be a positive integer")
    if not shift > 0:
        raise ConfigError("flow_shift", shift, "must be > 0")
    sigma = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    shifted = shift * sigma / (1.0 + (shift - 1.0) * sigma)
    return shifted.float()


def flow_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """Model timesteps t = 1000 * sigma' for each step (the last sigma, 0, is never evaluated)."""
    return sigmas[:-1] * 1000.0


def euler_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """x <- x + (sigma_next - sigma) * v, in fp32 (latents stay fp32 across steps)."""
    dt = float(sigma_next) - float(sigma)
    return x.float() + dt * v.float()


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, w: float) -> torch.Tensor:
    """Classifier-free guidance: uncond + w * (cond - uncond)."""
    return uncond + w * (cond - uncond)


def release_noise(shape, generator: torch.Generator) -> torch.Tensor:
    """N(0, I) drawn as the release pipeline draws its initial noise (`prepare_latents`: randn in bfloat16),
    returned as fp32 for the fp32 denoising loop. Drawn in bf16 itself: torch's CPU bf16 draw is not the fp32
    draw rounded when the element count is not a multiple of 16 (its vectorised tail differs)."""
    return torch.randn(shape, generator=generator, dtype=torch.bfloat16).float()


def initial_latents(cfg: HunyuanImage3Config, h: int, w: int, seed: int,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """The initial noise [1, C, h, w] (bf16 values, fp32 tensor) from a fresh generator for `seed`, as the
    release's text-to-image request; drawn on CPU so a seed gives the same noise everywhere."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    return release_noise((1, cfg.latent_channels, h, w), g).to(device)


class FlowMatchEulerSampler:
    """The release's sampler as one object, in the shape of diffusers' schedulers: `set_timesteps`
    fixes a request's noise levels, `timestep(i)` is the model's input at step `i`, `guide` combines
    the CFG branches and `step` moves the latents from step `i` to `i + 1`. One instance per request
    (it holds that request's sigmas)."""

    def __init__(self, shift: float):
        self.shift = shift
        self.sigmas: torch.Tensor | None = None

    def set_timesteps(self, steps: int) -> None:
        self.sigmas = flow_sigmas(steps, self.shift)

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1

    def timestep(self, i: int, device=None) -> torch.Tensor:
        """The model's timestep input of step `i`, fp32 [1]."""
        return (self.sigmas[i] * 1000.0).reshape(1).to(device)

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
        """The velocity to step with: CFG over the two branches, or the one branch (`uncond` None)."""
        return cond if uncond is None else cfg_combine(cond, uncond, scale)

    def step(self, v: torch.Tensor, i: int, x: torch.Tensor) -> torch.Tensor:
        return euler_step(x, v, self.sigmas[i], self.sigmas[i + 1])
