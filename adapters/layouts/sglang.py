"""The `sglang` on-disk layout: the tensor names and shapes SGLang 0.5.23 loads for an Inkling base.

SGLang's `LoRAAdapter` normalizes an adapter's tensors by name, then its memory pool copies them
into per-module buffers; names it does not recognise are dropped without a word. So the names
here are the ones its Inkling code path expects, spelled as Inkling's HF-format LoRA adapters
spell them (checkpoint module names under `language_model.`), module by module:

    attn   q/k/v/r/o_proj   attn.wq_du / wk_dv / wv_dv / wr_du / wo_ud   A [r, in], B [out, r]
           (SGLang concatenates q, k, v, r into its fused `qkvr` module: A [4r, H], B [sum out, r])
    mlp    gate/up/down     mlp.gate_proj / up_proj / down_proj         A [r, in], B [out, r]
           (stacked into `gate_up_proj`: A [2r, H], B [2F, r])
    experts gate/up          mlp.experts.w1 / w3    A [1, r, H] (shared), B [E, F, r]
           down             mlp.experts.w2         A [E, r, F],          B [1, H, r] (shared)
           (expert dim 1 marks the shared outer factor; w1/w3 are stacked into `gate_up_proj`)
    shared_experts gate/up   mlp.shared_experts.w1 / w3   A [r, H], B [S*F, r]   (flat)
           down             mlp.shared_experts.w2        A [r, S*F], B [H, r]   (flat)
           (`_normalize_shared_expert_moe` reshapes the flat factors to the 3-D shared-outer form)
    lm_head                 lm_head                A [r, H], B [V, r]

All five target groups are served (`supported_lora_modules` of SGLang's Inkling: qkvr, wo_ud,
gate_up_proj, down_proj, embed_tokens, lm_head); the one thing SGLang cannot serve is `mlp` LoRA on
a dense layer that follows a MoE layer, since it builds dense MLPs only for the leading layers.

Tensor names are `<prefix>.<module>.lora_A.weight` / `.lora_B.weight`. `adapter_config.json`
holds the PEFT `LoraConfig` fields SGLang's `LoRAConfig` reads (its `target_modules` are SGLang's
normalized module names, which is what it uses to size its buffers) plus our metadata under the
`inkwell` key, which SGLang keeps but never reads.

SGLang has one rank and one `lora_alpha / r` scaling per adapter. A spec whose groups have
different ranks is written at the largest rank R: a group of rank r gets zero rows appended to
A and zero columns to B, and its B is multiplied by R / r so that SGLang's alpha / R scaling
yields the group's alpha / r. This is the only case where the layout scales B. The round trip
is bit-exact when all ranks are equal or every R / r is a power of two; otherwise B comes back
within one rounding of its dtype.
"""

import re

import torch
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.errors import LayoutError
from inkwell.adapters.layouts.lora_config import plain_lora_problem
from inkwell.adapters.spec import TARGET_GROUPS, LoraSpec
from inkwell.adapters.targets import Target, expected_shapes, model_targets

LAYOUT = "sglang"
FORMAT_VERSION = 1
PREFIX = "language_model"
METADATA_KEY = "inkwell"

_ATTN = {"q_proj": "wq_du", "k_proj": "wk_dv", "v_proj": "wv_dv", "r_proj": "wr_du", "o_proj": "wo_ud"}
_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# The Inkling LoRA modules (InklingForConditionalGeneration.supported_lora_modules) each group feeds.
SGLANG_MODULES = {
    "attn": ("qkvr", "wo_ud"),
    "mlp": ("gate_up_proj", "down_proj"),
    "experts": ("gate_up_proj", "down_proj"),
    "shared_experts": ("gate_up_proj", "down_proj"),
    "lm_head": ("lm_head",),
}


class SglangLayoutError(LayoutError):
    """An adapter that cannot be written in, or read from, the sglang layout, and why."""


def module_name(target: Target) -> str:
    """The module path of `target` in the sglang layout, without the `.lora_X.weight` suffix."""
    if target.group == "lm_head":
        return f"{PREFIX}.lm_head"
    layer = f"{PREFIX}.layers.{target.layer}"
    if target.group == "attn":
        return f"{layer}.attn.{_ATTN[target.proj]}"
    if target.group == "mlp":
        return f"{layer}.mlp.{target.proj}"
    return f"{layer}.mlp.{target.group}.{_EXPERT[target.proj]}"


def tensor_name(target: Target, factor: str) -> str:
    """The sglang-layout tensor name of one factor (`lora_A` or `lora_B`) of `target`."""
    return f"{module_name(target)}.{factor}.weight"


def to_sglang(adapter: Adapter, config: InklingTextConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter's tensors by sglang name and its `adapter_config.json` dict.

    Tensors are views of the adapter's own where no reshaping or padding is needed.
    """
    spec = adapter.spec
    _check_servable(config, spec)
    targets = model_targets(config, spec)
    _check_shapes(adapter.tensors, expected_shapes(config, spec), "adapter")
    max_rank = spec.max_rank
    out: dict[str, torch.Tensor] = {}
    for target in targets:
        a, b = adapter.factors(target)
        a, b = _pad_rank(a, b, spec.rank_for(target.group), max_rank)
        a, b = _to_layout(target, a, b)
        out[tensor_name(target, "lora_A")] = a.contiguous()
        out[tensor_name(target, "lora_B")] = b.contiguous()
    return out, sglang_config(adapter)


def sglang_config(adapter: Adapter) -> dict:
    """The PEFT `LoraConfig` fields SGLang reads, plus our metadata under `inkwell`."""
    spec = adapter.spec
    modules = sorted({m for group in spec.targets for m in SGLANG_MODULES[group]})
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": adapter.base.name,
        "r": spec.max_rank,
        "lora_alpha": alpha,
        "lora_dropout": spec.dropout,
        "target_modules": modules,
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        METADATA_KEY: {
            "layout": LAYOUT,
            "format_version": FORMAT_VERSION,
            "spec": spec.model_dump(mode="json"),
            "base": adapter.base.to_dict(),
        },
    }


def from_sglang(
    tensors: dict[str, torch.Tensor], adapter_config: dict, config: InklingTextConfig
) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """The spec and canonical tensors (names of adapters/targets.py) of an sglang-layout adapter.

    An adapter without our `inkwell` metadata was written by another tool: any form SGLang's
    Inkling loader accepts is read (see `_adopt_foreign`) and its spec is inferred.
    """
    _check_peft_type(adapter_config)
    if METADATA_KEY not in adapter_config:
        return _adopt_foreign(tensors, adapter_config, config)
    spec = spec_from_config(adapter_config)
    targets = model_targets(config, spec)
    max_rank = spec.max_rank
    expected: dict[str, tuple[int, ...]] = {}
    for target in targets:
        shapes = _layout_shapes(target, max_rank)
        expected[tensor_name(target, "lora_A")] = shapes["lora_A"]
        expected[tensor_name(target, "lora_B")] = shapes["lora_B"]
    _check_shapes(tensors, expected, "sglang adapter")
    out: dict[str, torch.Tensor] = {}
    for target in targets:
        a, b = _from_layout(target, tensors[tensor_name(target, "lora_A")], tensors[tensor_name(target, "lora_B")])
        a, b = _unpad_rank(a, b, spec.rank_for(target.group), max_rank, module_name(target))
        out[f"{target.module}.lora_A"] = a.contiguous()
        out[f"{target.module}.lora_B"] = b.contiguous()
    return spec, out


def _check_peft_type(adapter_config: dict) -> None:
    problem = plain_lora_problem(adapter_config)
    if problem:
        raise SglangLayoutError(f"adapter_config.json: {problem}")


def spec_from_config(adapter_config: dict) -> LoraSpec:
    """Our LoraSpec from the `inkwell` metadata of `adapter_config.json`, checked against its PEFT fields."""
    meta = adapter_config.get(METADATA_KEY)
    if not isinstance(meta, dict) or "spec" not in meta:
        raise SglangLayoutError(
            f"adapter_config.json: {METADATA_KEY!r} is not a mapping with a 'spec'; the file is corrupt "
            f"(remove the {METADATA_KEY!r} key to read it as an adapter written by another tool)"
        )
    if meta.get("layout") != LAYOUT:
        raise SglangLayoutError(
            f"adapter_config.json: layout is {meta.get('layout')!r}, not {LAYOUT!r}; read it with that layout's reader"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise SglangLayoutError(
            f"adapter_config.json: format_version {meta.get('format_version')!r} is not {FORMAT_VERSION}; "
            "upgrade inkwell to read it"
        )
    try:
        spec = LoraSpec.model_validate(meta["spec"])
    except ValueError as exc:
        raise SglangLayoutError(f"adapter_config.json: invalid {METADATA_KEY}.spec: {exc}") from exc
    if adapter_config.get("r") != spec.max_rank or adapter_config.get("lora_alpha") != spec.alpha:
        raise SglangLayoutError(
            f"adapter_config.json: r={adapter_config.get('r')!r}, lora_alpha={adapter_config.get('lora_alpha')!r} "
            f"disagree with {METADATA_KEY}.spec (max rank {spec.max_rank}, alpha {spec.alpha}); the file was edited "
            "by hand or is corrupt"
        )
    return spec


def _check_servable(config: InklingTextConfig, spec: LoraSpec) -> None:
    """Every target group is an Inkling LoRA module of SGLang; only the base's layer order can fail."""
    # SGLang builds dense MLPs only for layers below `dense_mlp_idx`: the dense layers must lead.
    kinds = list(config.mlp_layer_types)
    leading = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    stray = [i for i, kind in enumerate(kinds) if kind == "dense" and i >= leading]
    if stray and "mlp" in spec.targets:
        raise SglangLayoutError(
            f"layers {stray} have dense MLPs after the first MoE layer ({leading}); SGLang's Inkling "
            "serves dense MLPs only before the MoE layers, so 'mlp' LoRA on them cannot be served"
        )


def _layout_shapes(target: Target, rank: int) -> dict[str, tuple[int, ...]]:
    shapes = target.shapes(rank)
    a, b = torch.empty(shapes["lora_A"], device="meta"), torch.empty(shapes["lora_B"], device="meta")
    a, b = _to_layout(target, a, b)
    return {"lora_A": tuple(a.shape), "lora_B": tuple(b.shape)}


def _check_shapes(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], what: str) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{name} {tuple(tensors[name].shape)} (expected {expected[name]})"
        for name in sorted(set(expected) & set(tensors))
        if tuple(tensors[name].shape) != expected[name]
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) its spec does not target: {', '.join(unexpected[:5])}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) of the wrong shape: {', '.join(wrong[:5])}")
    if problems:
        raise SglangLayoutError(
            f"{what} does not match its spec on this base model: "
            + "; ".join(problems)
            + " (was it trained with another spec or on another base?)"
        )


def _to_layout(target: Target, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical factors -> sglang factors (see the module docstring)."""
    if target.group == "experts":
        return (a.unsqueeze(0), b) if target.kind == "expert_in" else (a, b.unsqueeze(0))
    if target.group == "shared_experts":
        if target.kind == "expert_in":
            return a, b.reshape(-1, b.shape[-1])  # [S, F, r] -> [S*F, r]
        return a.permute(1, 0, 2).reshape(a.shape[1], -1), b  # [S, r, F] -> [r, S*F]
    return a, b


def _from_layout(target: Target, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sglang factors -> canonical factors; the inverse of _to_layout."""
    if target.group == "experts":
        return (a.squeeze(0), b) if target.kind == "expert_in" else (a, b.squeeze(0))
    if target.group == "shared_experts":
        s = target.num_experts
        if target.kind == "expert_in":
            return a, b.reshape(s, -1, b.shape[-1])
        return a.reshape(a.shape[0], s, -1).permute(1, 0, 2), b
    return a, b


def _pad_rank(a: torch.Tensor, b: torch.Tensor, rank: int, max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad A's rank rows and B's rank columns to max_rank, folding max_rank / rank into B."""
    if rank == max_rank:
        return a, b
    pad_a = a.new_zeros(*a.shape[:-2], max_rank - rank, a.shape[-1])
    pad_b = b.new_zeros(*b.shape[:-1], max_rank - rank)
    scaled = (b.double() * (max_rank / rank)).to(b.dtype)
    return torch.cat([a, pad_a], dim=-2), torch.cat([scaled, pad_b], dim=-1)


def _unpad_rank(
    a: torch.Tensor, b: torch.Tensor, rank: int, max_rank: int, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if rank == max_rank:
        return a, b
    if a[..., rank:, :].any() or b[..., rank:].any():
        raise SglangLayoutError(
            f"{name}: its group has rank {rank} but the padding beyond rank {rank} (up to {max_rank}) is not "
            "zero; the tensors were not written by to_sglang for this spec"
        )
    return a[..., :rank, :], (b[..., :rank].double() * (rank / max_rank)).to(b.dtype)


# Another tool's tensor name: any prefix, then `layers.<i>.<module>` or the LM head.
_FOREIGN_NAME = re.compile(
    r"^(?:.*\.)?(?:layers\.(?P<layer>\d+)\.(?P<module>[\w.]+?)|(?P<head>lm_head|unembed_tokens))"
    r"\.lora_(?P<factor>[AB])\.weight$"
)
_FOREIGN_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate_proj": "gate_proj"}
_FOREIGN_MLP |= {"up_proj": "up_proj", "down_proj": "down_proj", "gate_up_proj": "gate_up_proj"}
_FOREIGN_ATTN = {v: k for k, v in _ATTN.items()} | {"qkvr": "qkvr"}
_FUSED = {"qkvr": ("q_proj", "k_proj", "v_proj", "r_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _adopt_foreign(
    tensors: dict[str, torch.Tensor], adapter_config: dict, config: InklingTextConfig
) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """Canonical tensors of an sglang adapter written by another tool, with its inferred spec.

    Accepted, as SGLang's Inkling loader accepts them: any name prefix; `w1/w3/w2` or
    `gate/up/down_proj`; fused `qkvr` and `gate_up_proj` (one A shared by the slices, or the
    slices' As stacked); shared experts flat or 3-D. A target with neither factor gets zero
    factors (no change), as SGLang zero-fills it. The spec has one rank (`r`) and the groups
    the tensors touch.
    """
    try:
        rank = int(adapter_config["r"])
        alpha = float(adapter_config["lora_alpha"])
        dropout = float(adapter_config.get("lora_dropout") or 0.0)
        by_key = {
            (t.layer, t.group, t.proj): t for t in model_targets(config, LoraSpec(rank=rank, targets=TARGET_GROUPS))
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise SglangLayoutError(f"adapter_config.json: needs a valid integer 'r' and a 'lora_alpha' ({exc})") from exc
    canonical: dict[str, torch.Tensor] = {}
    groups: set[str] = set()
    for name, tensor in tensors.items():
        layer, group, proj, factor = _parse_foreign(name)
        parts = _FUSED.get(proj, (proj,))
        targets = [by_key.get((layer, group, p)) for p in parts]
        if None in targets:
            where = f"layer {layer}" if layer is not None else "the model"
            raise SglangLayoutError(f"{name}: {where} of this base model has no {group} {proj}", name)
        for target, piece in zip(targets, _split_fused(name, tensor, factor, targets, rank), strict=True):
            key = f"{target.module}.{factor}"
            if key in canonical:
                raise SglangLayoutError(f"{name}: {target.module} {factor} is given twice (fused and split)", name)
            canonical[key] = piece.contiguous()
        groups.add(group)
    try:
        spec = LoraSpec(rank=rank, alpha=alpha, dropout=dropout, targets=[g for g in TARGET_GROUPS if g in groups])
    except ValueError as exc:
        raise SglangLayoutError(f"adapter_config.json: not a usable LoRA config ({exc})") from exc
    dtype = next(iter(tensors.values())).dtype
    for target in model_targets(config, spec):
        names = [f"{target.module}.{f}" for f in ("lora_A", "lora_B")]
        present = [n in canonical for n in names]
        if not any(present):
            for n, shape in zip(names, target.shapes(rank).values(), strict=True):
                canonical[n] = torch.zeros(shape, dtype=dtype)
        elif not all(present):
            raise SglangLayoutError(f"{module_name(target)}: has only one of lora_A / lora_B", module_name(target))
    _check_shapes(canonical, expected_shapes(config, spec), "sglang adapter")
    return spec, canonical


def _parse_foreign(name: str) -> tuple[int | None, str, str, str]:
    """(layer, group, canonical proj or fused name, lora_A|lora_B) of another tool's tensor name."""
    match = _FOREIGN_NAME.match(name)
    factor = f"lora_{match['factor']}" if match else ""
    if match and match["head"]:
        return None, "lm_head", "lm_head", factor
    parts = match["module"].split(".") if match else []
    if len(parts) == 2 and parts[0] == "attn" and parts[1] in _FOREIGN_ATTN:
        return int(match["layer"]), "attn", _FOREIGN_ATTN[parts[1]], factor
    if len(parts) == 2 and parts[0] == "mlp" and parts[1] in _FOREIGN_MLP:
        return int(match["layer"]), "mlp", _FOREIGN_MLP[parts[1]], factor
    if len(parts) == 3 and parts[:2] in (["mlp", "experts"], ["mlp", "shared_experts"]) and parts[2] in _FOREIGN_MLP:
        return int(match["layer"]), parts[1], _FOREIGN_MLP[parts[2]], factor
    raise SglangLayoutError(
        f"{name}: not an Inkling LoRA tensor inkwell reads (expected layers.<i>.attn.wq_du|wk_dv|wv_dv|wr_du|wo_ud|"
        "qkvr, layers.<i>.mlp[.experts|.shared_experts].w1|w3|w2|gate_up_proj, or lm_head, then .lora_A/B.weight)",
        name,
    )


def _split_fused(name: str, tensor: torch.Tensor, factor: str, targets: list[Target], rank: int) -> list[torch.Tensor]:
    """One canonical factor per target: reshaped to canonical form, fused slices split apart."""
    first = targets[0]
    try:
        if first.group == "experts" or (first.group == "shared_experts" and tensor.dim() == 3):
            shared = (factor == "lora_A") == (first.kind == "expert_in")
            if shared and tensor.dim() == 3 and tensor.shape[0] != 1:
                raise SglangLayoutError(
                    f"{name}: per-expert {factor} (expert dim {tensor.shape[0]}); inkwell adapters use the "
                    "shared-outer form, where this factor has expert dim 1",
                    name,
                )
            tensor = tensor[0] if shared and tensor.dim() == 3 else tensor
        elif first.group == "shared_experts" and factor == "lora_B" and first.kind == "expert_in":
            tensor = tensor.reshape(first.num_experts, -1, tensor.shape[-1])  # [S*F, r] -> [S, F, r]
        elif first.group == "shared_experts" and factor == "lora_A" and first.kind == "expert_out":
            tensor = tensor.reshape(tensor.shape[0], first.num_experts, -1).permute(1, 0, 2)
    except RuntimeError as exc:
        raise SglangLayoutError(
            f"{name}: shape {tuple(tensor.shape)} does not fit {first.module} ({exc})", name
        ) from exc
    if len(targets) == 1:
        return [tensor]
    # Pieces are copies: tensors sharing storage cannot be saved to one safetensors file.
    if factor == "lora_A":  # one A shared by the slices, or the slices' As stacked on the rank dim
        if tensor.shape[-2] == rank * len(targets):
            return [piece.clone() for piece in tensor.split(rank, dim=-2)]
        return [tensor.clone() for _ in targets]
    sizes = [t.out_features for t in targets]
    if tensor.shape[-2] != sum(sizes):
        raise SglangLayoutError(
            f"{name}: lora_B has {tensor.shape[-2]} output rows, expected {sum(sizes)} ({' + '.join(map(str, sizes))})",
            name,
        )
    return [piece.clone() for piece in tensor.split(sizes, dim=-2)]
