"""LoRA SFT step time on one GPU: inkwell's megatron-core Inkling trainer vs transformers + peft.

Both train the same randomly initialised `inkling-small` weights (bf16) on the same batch
(--batch sequences x --seq tokens, next-token loss, AdamW), LoRA rank 16 / alpha 32 on attention,
the dense MLP and the routed experts (peft: `target_modules` + `target_parameters`, the setup
FACTS.md measured). Also: our full-parameter step (every base weight trainable) to report LoRA's
step time as a fraction of it, peak GPU memory of each, and correctness checks run first: our
logits vs transformers' eager logits, and each variant of ours (layers compiled or not, and how)
against our uncompiled eager model (loss and LoRA gradients).
Step times are medians over --steps timed steps after --warmup untimed ones.
Run: python benchmarks/bench_train.py [--batch 4] [--seq 1024] [--steps 10] [--modes none default reduce-overhead]
[--out results.json] [--md table.md] [--profile DIR]
"""

import argparse
import datetime
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from transformers import InklingForCausalLM

from inkwell.adapters.adapter import init_adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models import config_identity, preset_config
from inkwell.models.names import canonical_name
from inkwell.trainer.bridge import is_lora, load_state
from inkwell.trainer.model import InklingGPT, compile_decoder_layers
from inkwell.trainer.parallel import model_parallel

GIB = 1024**3
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "r_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# (attention, torch.compile mode of the layers or None) of our trainer, timed in this order
VARIANTS = [
    ("eager", None),
    ("eager", "default"),
    ("eager", "reduce-overhead"),
]


def variant_key(attention: str, mode: str | None) -> str:
    return f"ours_lora_{attention}" + (f"_compiled_{mode}" if mode else "")


def time_steps(step, steps: int, warmup: int) -> dict:
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
    return {"ms": 1000 * statistics.median(times), "peak_gib": peak}


def profile_steps(step, path: Path, steps: int = 3) -> None:
    """Write torch.profiler's per-op table (sorted by device time) of `steps` steps to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90)
    path.write_text(f"{steps} steps\n{table}\n")


def make_step(forward, params, ids, targets, fused: bool = False):
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=fused)

    def step():
        loss = forward(ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def random_rows(vocab_size: int, args) -> torch.Tensor:
    """The training benchmarks' batch: `args.batch` rows of `args.seq` random token ids (seeded, on the CPU)."""
    return torch.randint(3, vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))


def run_header(args) -> dict:
    """What a training benchmark's results start with: the shapes, the hardware, torch and the date."""
    return {
        "preset": args.preset,
        "batch": args.batch,
        "seq": args.seq,
        "rank": args.rank,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def bench_peft(config, args, ids, targets, check_ids, results: dict):
    """Time transformers + peft; return the base weights (CPU) and reference logits for our model."""
    from peft import LoraConfig, get_peft_model

    with torch.device(args.device):
        hf = InklingForCausalLM(config).to(torch.bfloat16)
    # under inkwell's names: transformers 5.17 (the H200's) spells the embedding norm its own way
    base_state = {canonical_name(k): v.detach().cpu().clone() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        ref_logits = hf(check_ids).logits.float()
    lora = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=PEFT_MODULES, target_parameters=PEFT_PARAMETERS
    )
    peft_model = get_peft_model(hf, lora)

    def peft_loss(x, y):
        logits = peft_model(input_ids=x).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    results["peft_lora_params_m"] = sum(p.numel() for p in trainable) / 1e6
    step = make_step(peft_loss, trainable, ids, targets)
    results["peft"] = time_steps(step, args.steps, args.warmup)
    if args.profile:
        profile_steps(step, args.profile / "profile_peft.txt")
    print("transformers+peft", results["peft"], flush=True)
    return base_state, ref_logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="inkling-small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--profile", type=Path, help="folder for torch.profiler tables of both LoRA trainers")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of this script")
    parser.add_argument(
        "--modes", nargs="+", default=[m or "none" for _, m in VARIANTS], help="compile modes of the layers to time"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    config = preset_config(args.preset)
    config._attn_implementation = "eager"
    ids = random_rows(config.vocab_size, args).to(args.device)
    targets = ids.roll(-1, dims=1)
    check_ids = ids[:1, : min(512, args.seq)]
    results = run_header(args)
    base_state, ref_logits = bench_peft(config, args, ids, targets, check_ids, results)
    results["parameters_b"] = sum(v.numel() for v in base_state.values()) / 1e9
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    spec = LoraSpec(rank=args.rank, alpha=2 * args.rank, targets=["attn", "mlp", "experts"])
    with model_parallel(tp=1, ep=1, device=args.device, seed=0):
        model = InklingGPT(config, spec, torch.bfloat16, args.device, "eager")
        load_state(model, base_state, lora=False)
        adapter = init_adapter(config, spec, config_identity(config, args.preset), seed=0, b_std=1e-3)
        load_state(model, adapter.tensors, lora=True)
        del base_state
        lora = [p for p in model.parameters() if is_lora(p)]
        results["ours_lora_params_m"] = sum(p.numel() for p in lora) / 1e6

        def ours_loss(x, y):
            return vocab_parallel_cross_entropy(model(x).float(), y).mean()

        with torch.no_grad():
            ours_logits = model(check_ids).float()
        results["logits_max_abs_diff_vs_transformers"] = (ours_logits - ref_logits).abs().max().item()
        results["logits_max_abs"] = ref_logits.abs().max().item()

        def lora_grads(name: str) -> tuple[float, list[torch.Tensor]]:
            model.set_attention(name)
            loss = ours_loss(check_ids, check_ids.roll(-1, dims=1))
            loss.backward()
            grads = [p.grad.float().clone() for p in lora]
            model.zero_grad(set_to_none=True)
            return loss.item(), grads

        reference_loss, reference_grads = lora_grads("eager")
        # FlexAttention has no CPU backward; a CPU smoke run skips it and compilation
        variants = [(a, m) for a, m in VARIANTS if (m or "none") in args.modes]
        variants = variants if args.device == "cuda" else [(a, m) for a, m in variants if a != "flex" and not m]
        compiled = None
        for attention, mode in variants:
            if mode != compiled:
                torch._dynamo.reset()
                compile_decoder_layers(model.layers, mode)
                compiled = mode
            key = variant_key(attention, mode)
            loss, grads = lora_grads(attention)
            rel = [((a - b).norm() / (a.norm() + 1e-12)).item() for a, b in zip(reference_grads, grads, strict=True)]
            results[f"{key}_vs_eager_loss_diff"] = abs(loss - reference_loss)
            results[f"{key}_vs_eager_grad_rel_diff_median"] = statistics.median(rel)
            results[f"{key}_vs_eager_grad_rel_diff_max"] = max(rel)
            step = make_step(ours_loss, lora, ids, targets, fused=args.device == "cuda")
            results[key] = time_steps(step, args.steps, args.warmup)
            if args.profile:
                profile_steps(step, args.profile / f"profile_{key}.txt")
            print(key, results[key], {k: v for k, v in results.items() if k.startswith(key + "_vs")}, flush=True)

        best = min((variant_key(*v) for v in variants), key=lambda k: results[k]["ms"])
        results["best"] = best
        results["variants"] = variants
        attention, mode = next((a, m) for a, m in variants if variant_key(a, m) == best)
        model.set_attention(attention)
        if mode != compiled:
            torch._dynamo.reset()
            compile_decoder_layers(model.layers, mode)
        # every base weight trainable and the adapter frozen: a weight that needs a gradient but is no optimizer's
        # (never zeroed) would add its next gradient into the last one, which CUDA graphs have overwritten by then
        for p in model.parameters():
            p.requires_grad_(not is_lora(p))
        base = [p for p in model.parameters() if p.requires_grad]
        full_step = make_step(ours_loss, base, ids, targets, fused=args.device == "cuda")
        results["ours_full"] = time_steps(full_step, args.steps, args.warmup)
        print("ours full", results["ours_full"], flush=True)

    tokens = args.batch * args.seq
    for key in ["peft", "ours_full"] + [variant_key(*v) for v in variants]:
        results[key]["tokens_per_s"] = tokens / (results[key]["ms"] / 1000)
    results["speedup_vs_peft"] = results["peft"]["ms"] / results[best]["ms"]
    results["lora_over_full_step"] = results[best]["ms"] / results["ours_full"]["ms"]
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.md:
        args.md.write_text(markdown(results))


def markdown(r: dict) -> str:
    rows = [("transformers + peft LoRA (eager attention)", "peft")]
    for attention, mode in r["variants"]:
        label = f"inkwell LoRA, {attention} attention" + (f", layers compiled ({mode})" if mode else "")
        rows.append((label, variant_key(attention, mode)))
    rows += [(f"inkwell full-parameter ({r['best']})", "ours_full")]
    lines = [
        f"## LoRA SFT training step: {r['preset']} ({r['parameters_b']:.2f}B), {r['gpu']}, {r['date']}",
        "",
        f"`python benchmarks/bench_train.py --batch {r['batch']} --seq {r['seq']} --rank {r['rank']}` "
        f"(torch {r['torch']}, bf16, AdamW, batch {r['batch']} x {r['seq']} tokens, rank {r['rank']} on "
        "attention + dense MLP + routed experts; median step of the timed steps)",
        "",
        "| trainer | ms / step | tokens / s | peak GiB | vs peft | loss diff vs eager "
        "| LoRA grad rel. diff (median / max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, key in rows:
        m = r[key]
        check = "- | -"
        if f"{key}_vs_eager_loss_diff" in r:
            check = (
                f"{r[f'{key}_vs_eager_loss_diff']:.2g} | {r[f'{key}_vs_eager_grad_rel_diff_median']:.2g} / "
                f"{r[f'{key}_vs_eager_grad_rel_diff_max']:.2g}"
            )
        speed = r["peft"]["ms"] / m["ms"]
        figures = f"{m['ms']:.1f} | {m['tokens_per_s']:,.0f} | {m['peak_gib']:.1f} | {speed:.2f}x"
        lines.append(f"| {name} | {figures} | {check} |")
    lines += [
        "",
        f"- Speed-up of the fastest ({r['best']}) over transformers + peft: **{r['speedup_vs_peft']:.2f}x** "
        "(target 2x).",
        f"- LoRA step time / full-parameter step time: {r['lora_over_full_step']:.2f}.",
        f"- Logits max |diff| vs transformers eager (bf16, 512 tokens): {r['logits_max_abs_diff_vs_transformers']:.3g} "
        f"(logits up to {r['logits_max_abs']:.3g}).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
