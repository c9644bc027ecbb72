"""The `peft` layout: what `peft.PeftModel.from_pretrained` loads onto transformers' Inkling.

Linear targets are `target_modules` (full module names). Expert weights are 3-D parameters, so
they are `target_parameters`; peft's ParamWrapper keeps per-expert factors stacked
(A [E*r, in] with expert e's rows at `A.view(E, r, in)[e]`, B [out, r*E] with expert e at
`B.view(out, r, E)[:, :, e]`), and several wrapped parameters of one module nest, the first
listed innermost (`experts.base_layer` holds it). Our shared factors are materialized per expert,
and the routed `gate_up_proj` (gate rows, then up rows) gets the block form of rank 2r.

peft applies one rank r* and one scaling lora_alpha / r* to target parameters, so every factor
is zero-padded to r* and B carries the ratio (r* / r_group): the layout demands this fold; it is
exact when the ratio is a power of two (the default specs) and undone on load.
"""

import torch
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.errors import LayoutError
from inkwell.adapters.spec import LoraSpec
from inkwell.adapters.targets import ATTN_PROJS, MLP_PROJS, Target, model_targets

PREFIX = "base_model.model."


class PeftLayoutError(LayoutError):
    """A peft adapter that cannot be represented in inkwell's shared-outer form."""


def _expert_params(parent: str, projs: list[str]) -> list[str]:
    """The wrapped 3-D parameters of one expert module, in target_parameters order."""
    if parent.endswith(".experts"):
        params = []
        if "gate_proj" in projs or "up_proj" in projs:
            params.append("gate_up_proj")
        if "down_proj" in projs:
            params.append("down_proj")
        return params
    return [p for p in ("gate_proj", "up_proj", "down_proj") if p in projs]


def _param_key(parent: str, params: list[str], param: str) -> str:
    depth = len(params) - 1 - params.index(param)
    return f"{PREFIX}{parent}" + ".base_layer" * depth


def _group_targets(config: InklingTextConfig, spec: LoraSpec):
    linear: list[Target] = []
    experts: dict[str, dict[str, Target]] = {}
    for t in model_targets(config, spec):
        if t.kind == "linear":
            linear.append(t)
        else:
            experts.setdefault(t.module.rsplit(".", 1)[0], {})[t.proj] = t
    return linear, experts


def peft_rank(spec: LoraSpec) -> int:
    """The one rank r* of the peft layout: room for every group, gate_up at twice its rank."""
    ranks = [spec.rank_for(g) * (2 if g == "experts" else 1) for g in spec.targets]
    return max(ranks)


def _pad_rows(a: torch.Tensor, r: int) -> torch.Tensor:
    return torch.cat([a, a.new_zeros(r - a.shape[0], *a.shape[1:])]) if a.shape[0] < r else a


def _pad_cols(b: torch.Tensor, r: int) -> torch.Tensor:
    return torch.cat([b, b.new_zeros(*b.shape[:-1], r - b.shape[-1])], dim=-1) if b.shape[-1] < r else b


def _stack(a_per_expert: list[torch.Tensor], b_per_expert: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's ParamWrapper layout from per-expert [r, in] and [out, r] factors."""
    return torch.cat(a_per_expert), torch.stack(b_per_expert, dim=-1).flatten(-2)


def to_peft(adapter: Adapter, config: InklingTextConfig) -> tuple[dict[str, torch.Tensor], dict]:
    spec = adapter.spec
    rs = peft_rank(spec)
    linear, experts = _group_targets(config, spec)
    tensors: dict[str, torch.Tensor] = {}
    for t in linear:
        a, b = adapter.factors(t)
        ratio = rs / spec.rank_for(t.group)
        tensors[f"{PREFIX}{t.module}.lora_A.weight"] = _pad_rows(a, rs).contiguous()
        tensors[f"{PREFIX}{t.module}.lora_B.weight"] = _pad_cols(b * ratio, rs).contiguous()
    target_parameters = []
    for parent, targets in experts.items():
        params = _expert_params(parent, list(targets))
        group = next(iter(targets.values())).group
        r = spec.rank_for(group)
        count = next(iter(targets.values())).num_experts
        ratio = rs / r
        for param in params:
            a_list, b_list = [], []
            for e in range(count):
                if param == "gate_up_proj":
                    ag, bg = adapter.factors(targets["gate_proj"])
                    au, bu = adapter.factors(targets["up_proj"])
                    a_e = torch.cat([ag, au])
                    b_e = torch.block_diag(bg[e], bu[e])
                else:
                    a, b = adapter.factors(targets[param])
                    a_e, b_e = (a, b[e]) if targets[param].kind == "expert_in" else (a[e], b)
                a_list.append(_pad_rows(a_e, rs))
                b_list.append(_pad_cols(b_e * ratio, rs))
            a_stacked, b_stacked = _stack(a_list, b_list)
            key = _param_key(parent, params, param)
            tensors[f"{key}.lora_A.weight"] = a_stacked.contiguous()
            tensors[f"{key}.lora_B.weight"] = b_stacked.contiguous()
            target_parameters.append(f"{parent}.{param}")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rs,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": [t.module for t in linear],
        "target_parameters": target_parameters,
        "base_model_name_or_path": adapter.base.name,
        "inference_mode": True,
    }
    return tensors, adapter_config


def _unstack(a: torch.Tensor, b: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert [E, r*, in] and [E, out, r*] from peft's stacked factors."""
    rs = a.shape[0] // count
    return a.view(count, rs, -1), b.view(b.shape[0], rs, count).permute(2, 0, 1)


def _shared(factors: torch.Tensor, what: str) -> torch.Tensor:
    if not torch.equal(factors, factors[:1].expand_as(factors)):
        raise PeftLayoutError(
            f"{what} differs between experts; inkwell adapters use the shared-outer factorization "
            "(gate/up A and down B shared by all experts of a layer)"
        )
    return factors[0]


def infer_spec(adapter_config: dict) -> LoraSpec:
    """The LoraSpec of a peft adapter written by another tool: one rank, groups from its names."""
    names = list(adapter_config.get("target_modules") or []) + list(adapter_config.get("target_parameters") or [])
    groups = []
    for name in names:
        parts = name.split(".")
        if "shared_experts" in parts:
            groups.append("shared_experts")
        elif "experts" in parts:
            groups.append("experts")
        elif parts[-1] in ATTN_PROJS:
            groups.append("attn")
        elif parts[-1] in MLP_PROJS:
            groups.append("mlp")
        elif parts[-1] == "lm_head":
            groups.append("lm_head")
        else:
            raise PeftLayoutError(f"target {name!r} is not an Inkling module (expected transformers Inkling names)")
    return LoraSpec(
        rank=int(adapter_config["r"]),
        alpha=float(adapter_config["lora_alpha"]),
        dropout=float(adapter_config.get("lora_dropout", 0.0)),
        targets=tuple(dict.fromkeys(groups)),
    )


def from_peft(
    tensors: dict[str, torch.Tensor], adapter_config: dict, config: InklingTextConfig, spec: LoraSpec
) -> dict[str, torch.Tensor]:
    """Canonical tensors of a peft-layout adapter whose LoraSpec is known (from its metadata)."""
    rs = int(adapter_config["r"])
    linear, experts = _group_targets(config, spec)
    out: dict[str, torch.Tensor] = {}

    def get(key: str) -> torch.Tensor:
        if key not in tensors:
            raise PeftLayoutError(f"tensor {key!r} is missing from adapter_model.safetensors")
        return tensors[key]

    for t in linear:
        r = spec.rank_for(t.group)
        ratio = rs / r
        out[f"{t.module}.lora_A"] = get(f"{PREFIX}{t.module}.lora_A.weight")[:r].contiguous()
        out[f"{t.module}.lora_B"] = (get(f"{PREFIX}{t.module}.lora_B.weight")[:, :r] / ratio).contiguous()
    for parent, targets in experts.items():
        params = _expert_params(parent, list(targets))
        first = next(iter(targets.values()))
        r, count = spec.rank_for(first.group), first.num_experts
        for param in params:
            key = _param_key(parent, params, param)
            a, b = _unstack(get(f"{key}.lora_A.weight"), get(f"{key}.lora_B.weight"), count)
            b = b / (rs / r)
            f = b.shape[1] // 2
            if param == "gate_up_proj" and 2 * r <= rs:  # block form written by to_peft
                pairs = {"gate_proj": (a[:, :r], b[:, :f, :r]), "up_proj": (a[:, r : 2 * r], b[:, f:, r : 2 * r])}
            elif param == "gate_up_proj":  # fused form (peft-trained): gate and up share one A
                pairs = {"gate_proj": (a[:, :r], b[:, :f, :r]), "up_proj": (a[:, :r], b[:, f:, :r])}
            else:
                pairs = {param: (a[:, :r], b[:, :, :r])}
            for proj, (a_e, b_e) in pairs.items():
                name = f"{parent}.{proj}"
                if targets[proj].kind == "expert_in":
                    out[f"{name}.lora_A"] = _shared(a_e, f"{name} lora_A").contiguous()
                    out[f"{name}.lora_B"] = b_e.contiguous()
                else:
                    out[f"{name}.lora_A"] = a_e.contiguous()
                    out[f"{name}.lora_B"] = _shared(b_e, f"{name} lora_B").contiguous()
    return out
