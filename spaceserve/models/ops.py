"""Dense operators of the models, in two implementations behind one interface.

`TorchOps` is plain PyTorch (cuBLAS and stock kernels; the baseline, any device), written to
follow transformers' Qwen2-VL numerics. `TritonOps` calls SpaceServe's budgeted kernels, each
launch under the `num_sms` of the stage entry point. Both return new tensors except `rotary`,
which may rotate its inputs in place: use its return values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spaceserve import kernels

Tensor = torch.Tensor


def activation_torch(x: Tensor, activation: str | None) -> Tensor:
    """The activations the models use, computed as transformers computes them."""
    if activation is None:
        return x
    if activation == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "silu":
        return F.silu(x)
    raise ValueError(f"activation={activation!r} is not one of quick_gelu, gelu, gelu_tanh, silu")


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    """Plain-PyTorch dense ops; `num_sms` is accepted and ignored (stock kernels)."""

    name = "torch"

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
               activation: str | None = None, num_sms: int | None = None) -> Tensor:
        return activation_torch(F.linear(x, weight, bias), activation)

    def gated_mlp(self, x: Tensor, w_gate_up: Tensor, w_down: Tensor, *,
                  b_gate_up: Tensor | None = None, b_down: Tensor | None = None,
                  num_sms: int | None = None) -> Tensor:
        """SwiGLU ``down(silu(gate) * up)``; `w_gate_up` ``[2I, K]``, gate rows first."""
        gate, up = F.linear(x, w_gate_up, b_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w_down, b_down)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, *, residual: Tensor | None = None,
                 num_sms: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
        summed = x if residual is None else x + residual
        h = summed.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(x.dtype)
        return out if residual is None else (out, summed)

    def head_rms_norm(self, x: Tensor, weight: Tensor, eps: float, *,
                      num_sms: int | None = None) -> Tensor:
        """RMSNorm of every head of x ``[T, H, D]`` by one weight ``[D]`` (Qwen3's per-head
        q/k norm): the row norm over ``[T * H, D]`` rows, so both op sets share it."""
        t, n, d = x.shape
        return self.rms_norm(x.reshape(t * n, d), weight, eps, num_sms=num_sms).view(t, n, d)

    def layer_norm(self, x: Tensor, weight: Tensor, bias: Tensor, eps: float, *,
                   num_sms: int | None = None) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def rotary(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *,
               num_sms: int | None = None) -> tuple[Tensor, Tensor]:
        """Rotate-half RoPE of q ``[T, Hq, D]`` and k ``[T, Hk, D]`` by fp32 tables
        ``[T, D]``, computed in fp32 and cast back."""
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        qf, kf = q.float(), k.float()
        q_out = (qf * c + rotate_half(qf) * s).to(q.dtype)
        k_out = (kf * c + rotate_half(kf) * s).to(k.dtype)
        return q_out, k_out


class TritonOps(TorchOps):
    """SpaceServe's persistent Triton kernels, each launch under the caller's budget.
    `rotary` rotates q and k in place (they may be views of a fused qkv output)."""

    name = "triton"

    def linear(self, x, weight, bias=None, *, activation=None, num_sms=None):
        return kernels.linear(x, weight, bias, activation=activation, num_sms=num_sms)

    def gated_mlp(self, x, w_gate_up, w_down, *, b_gate_up=None, b_down=None, num_sms=None):
        return kernels.gated_mlp(x, w_gate_up, w_down, b_gate_up=b_gate_up, b_down=b_down,
                                 num_sms=num_sms)

    def rms_norm(self, x, weight, eps, *, residual=None, num_sms=None):
        return kernels.rms_norm(x, weight, eps, residual=residual, num_sms=num_sms)

    def layer_norm(self, x, weight, bias, eps, *, num_sms=None):
        return kernels.layer_norm(x, weight, bias, eps, num_sms=num_sms)

    def rotary(self, q, k, cos, sin, *, num_sms=None):
        return kernels.apply_rotary(q, k, cos, sin, num_sms=num_sms)


def make_ops(name: str) -> TorchOps:
    """Dense ops by name: "triton" (SpaceServe kernels) or "torch" (stock PyTorch)."""
    if name == "triton":
        return TritonOps()
    if name == "torch":
        return TorchOps()
    raise ValueError(f"dense ops {name!r} unknown; known: triton, torch")
