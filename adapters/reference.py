"""The oracle: LoRA applied unmerged to transformers' InklingForCausalLM, the plain way.

Linear targets get a forward hook adding scaling * x A^T B^T. Routed and shared experts get a
forward that evaluates every expert with its own delta computed as x A^T B^T (never merged), so
this path shares no arithmetic with `merge`. Tests compare every other implementation with it.
"""

import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers import InklingForCausalLM

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.targets import Target, model_targets


def _linear_hook(a: torch.Tensor, b: torch.Tensor, scaling: float):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        return output + scaling * F.linear(F.linear(x.to(a.dtype), a), b).to(output.dtype)

    return hook


def _expert_lora(x: torch.Tensor, e: int, target: Target, adapter: Adapter) -> torch.Tensor:
    a, b = adapter.factors(target)
    if target.kind == "expert_in":
        return adapter.scaling(target) * F.linear(F.linear(x, a), b[e])
    return adapter.scaling(target) * F.linear(F.linear(x, a[e]), b)


def _routed_forward(lora: dict[str, Target], adapter: Adapter):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        f = self.intermediate_dim
        for e in range(self.num_experts):
            token_idx, k_pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = hidden_states[token_idx]
            gate = F.linear(x, self.gate_up_proj[e, :f])
            up = F.linear(x, self.gate_up_proj[e, f:])
            if "gate_proj" in lora:
                gate = gate + _expert_lora(x, e, lora["gate_proj"], adapter)
            if "up_proj" in lora:
                up = up + _expert_lora(x, e, lora["up_proj"], adapter)
            h = self.act_fn(gate) * up
            y = F.linear(h, self.down_proj[e])
            if "down_proj" in lora:
                y = y + _expert_lora(h, e, lora["down_proj"], adapter)
            out.index_add_(0, token_idx, y * top_k_weights[token_idx, k_pos, None])
        return out

    return forward


def _shared_forward(lora: dict[str, Target], adapter: Adapter):
    def forward(self, hidden_states, gammas):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        g = gammas.reshape(-1, self.n_shared_experts)
        out = torch.zeros_like(x, dtype=torch.float32)
        for s in range(self.n_shared_experts):
            gate = F.linear(x, self.gate_proj[s])
            up = F.linear(x, self.up_proj[s])
            if "gate_proj" in lora:
                gate = gate + _expert_lora(x, s, lora["gate_proj"], adapter)
            if "up_proj" in lora:
                up = up + _expert_lora(x, s, lora["up_proj"], adapter)
            h = self.act_fn(gate) * up * g[:, s, None]
            y = F.linear(h, self.down_proj[s])
            if "down_proj" in lora:
                y = y + _expert_lora(h, s, lora["down_proj"], adapter)
            out += y.float()
        return out.to(hidden_states.dtype).view(shape)

    return forward


def apply_lora(model: InklingForCausalLM, adapter: Adapter) -> list:
    """Attach `adapter` to `model` in place; returns the hook handles (remove them to detach)."""
    handles = []
    experts: dict[str, dict[str, Target]] = {}
    for target in model_targets(model.config, adapter.spec):
        if target.kind == "linear":
            a, b = adapter.factors(target)
            module = model.get_submodule(target.module)
            handles.append(module.register_forward_hook(_linear_hook(a, b, adapter.scaling(target))))
        else:
            experts.setdefault(target.module.rsplit(".", 1)[0], {})[target.proj] = target
    for parent, lora in experts.items():
        module = model.get_submodule(parent)
        make = _routed_forward if parent.endswith(".experts") else _shared_forward
        module.forward = types.MethodType(make(lora, adapter), module)
    return handles
