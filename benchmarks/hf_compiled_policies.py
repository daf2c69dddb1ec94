"""Each activation policy on a Hugging Face Llama's layers, compiled in place, one subprocess per case: which of them
trains, and which faults. A diagnostic for the twentieth session's fault (``BENCHMARKS.md``): ``fit(compile=True)`` on
the TinyLlama shape at 16 GiB died with an illegal memory access in its first backward, where each policy alone,
with fp32 weights under autocast, trained.

    python3 benchmarks/hf_compiled_policies.py                        # fp32 weights + autocast, AdamW on the device
    python3 benchmarks/hf_compiled_policies.py --weights bf16 --host  # a plan's bf16 layout, the optimizer on the host
    CUDA_LAUNCH_BLOCKING=1 python3 benchmarks/hf_compiled_policies.py --weights bf16 --host --cases mix
    python3 benchmarks/hf_compiled_policies.py --weights bf16 --host --cases mix --cap 4  # capped, expandable
    python3 benchmarks/hf_compiled_policies.py --plan PLAN.toml --cases as-is,no-host  # fit's plan (hf_fit.py
        --save-plans), and variants of it
    python3 benchmarks/hf_compiled_policies.py --plan PLAN.toml --cases as-is --profile-first fit  # as fit runs

The twenty-first session's calls: fit's own 16 GiB plan, applied and compiled in a fresh process, trained in all five
variants, where ``fit`` with that plan faulted (uncapped too, and without donated buffers); what fit does first, its
compiled profiles in the same process, is what ``--profile-first`` adds. The twenty-second session's: after those
profiles the plan faulted, and with ``--dynamo-reset`` it trained; a compiled profile now clears the compiler's
caches itself, so ``--profile-first`` no longer reproduces the fault.

Each case builds the model (TinyLlama's widths, ``--layers`` layers, 4 x 2048 tokens), applies a hand Plan through
``elbowroom.plan.apply`` (as ``fit`` does: the weight layout, the optimizer, the activation policies), compiles the
blocks (``compile_blocks``), and runs three steps of the plain Hugging Face loop (``model(**batch).loss``). A case
that faults prints its last error line and the innermost elbowroom or torch frame; ``--eager`` runs the same cases
without compiling, the reference. ``--tiny`` runs them on CPU in seconds (no copies: nothing is offloaded there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = {
    "keep": [dict()],
    "keep-off0.5": [dict(offload_ratio=0.5)],
    "selective": [dict(checkpoint="selective")],
    "sel-off0.5": [dict(checkpoint="selective", offload_ratio=0.5)],
    "sel-offall": [dict(checkpoint="selective", offload_ratio=1.0, offload_input=True)],
    "full": [dict(checkpoint="full")],
    "full-input": [dict(checkpoint="full", offload_input=True)],
    # a planner's mix, block by block (the rows repeat over the layers)
    "mix": [dict(checkpoint="selective", offload_ratio=1.0, offload_input=True), dict(checkpoint="full"),
            dict(checkpoint="selective"), dict(offload_ratio=0.75)],
}


def _blocks(plan, change):
    return dataclasses.replace(plan, blocks=tuple(dataclasses.replace(b, **change(b)) for b in plan.blocks))


# variants of a saved plan (--plan): which of its parts a fault needs
PLAN_VARIANTS = {
    "as-is": lambda p: p,
    "no-input-offload": lambda p: _blocks(p, lambda b: {"offload_input": False}),
    "no-activation-offload": lambda p: _blocks(p, lambda b: {"offload_input": False, "offload_ratio": 0.0}),
    "no-host": lambda p: dataclasses.replace(_blocks(p, lambda b: {"optimizer_on_host": False,
                                                                          "optimizer_streamed": False}),
                                             offload_gradients=False, offload_other_params=False,
                                             offload_head_params=False),
    "recompute-all": lambda p: _blocks(p, lambda b: {"checkpoint": "full", "offload_ratio": 0.0}),
}


def one(case: str, args: argparse.Namespace) -> dict:
    import transformers

    from elbowroom.activations import compile_blocks
    from elbowroom.plan import BlockPlan, Plan, apply

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    torch.manual_seed(0)
    kw = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
              vocab_size=32000, max_position_embeddings=4096)
    if args.tiny:
        kw.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=128)
    layers = len(Plan.load(args.plan).blocks) if args.plan else args.layers
    cfg = transformers.LlamaConfig(**kw, num_hidden_layers=layers, attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    if args.plan:  # a saved plan (fit's), varied by ``case`` (see PLAN_VARIANTS)
        plan = PLAN_VARIANTS[case](Plan.load(args.plan))
        bf16 = plan.weight_dtype == "bfloat16"
    else:
        rows = CASES[case]
        host = args.host
        blocks = tuple(BlockPlan(index=i, **rows[i % len(rows)], optimizer_on_host=host and i >= args.layers // 2)
                       for i in range(args.layers))
        bf16 = args.weights == "bf16"
        plan = Plan(blocks=blocks, budget_bytes=1 << 40, predicted_peak_bytes=0, predicted_step_seconds=1.0,
                    predicted_tokens_per_s=1.0, weight_dtype="bfloat16" if bf16 else "float32",
                    offload_param_dtype="bfloat16" if bf16 else "float32", offload_gradients=host,
                    offload_other_params=host)
    seq = 32 if args.tiny else 2048
    ids = torch.randint(0, cfg.vocab_size, (4, seq), device=device)
    if args.profile_first != "none":  # what fit does before it applies a plan: profile the model in this process
        from elbowroom.plan import profile
        from elbowroom.plan.fit import profile_bf16_copy
        from elbowroom.plan.profiler import profile as take_profile

        batch = {"input_ids": ids, "labels": ids}
        prof = profile(model, batch, compiled=not args.eager, reentrant=False, dtype=torch.bfloat16)
        if args.profile_first == "fit":  # and its bf16 copy, profiled the same way
            profile_bf16_copy(model, batch, prof, take_profile, None, False, compiled=not args.eager)
        if args.dynamo_reset:
            torch._dynamo.reset()
    # (fit applies with the non-reentrant checkpoint when it compiles)
    model, opt = apply(model, plan, torch.optim.AdamW, lr=1e-4, fused=device.type == "cuda",
                       reentrant=None if args.eager else False)
    if args.cap and device.type == "cuda":  # as fit's rows run: the allocator capped at a budget (and see main)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap * 2**30 / torch.cuda.mem_get_info()[1]))
    if not args.eager:
        compile_blocks(model)
    losses = []
    for _ in range(3):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"case": case, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--weights", default="fp32", choices=["fp32", "bf16"],
                    help="fp32 weights under bf16 autocast, or bf16 weights with fp32 masters (a plan's layout)")
    ap.add_argument("--host", action="store_true",
                    help="the later half of the blocks, the embedding and the head stepped on the host, their "
                         "gradients leaving in the backward (offload_gradients)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--eager", action="store_true", help="the same cases without compiling (the reference)")
    ap.add_argument("--tiny", action="store_true", help="small widths, on CPU")
    ap.add_argument("--cap", type=float, default=0.0,
                    help="cap the CUDA allocator at this many GiB once the plan is applied, with expandable segments, "
                         "as a plan's run is: a cap that binds makes the allocator free and unmap its cache")
    ap.add_argument("--plan", help="apply this saved plan (as hf_fit.py --save-plans writes fit's) in place of the "
                    f"hand plans; --cases then names its variants, of {', '.join(PLAN_VARIANTS)}")
    ap.add_argument("--profile-first", default="none", choices=["none", "plain", "fit"],
                    help="profile the model in the case's process before applying the plan, as fit does: 'plain' "
                         "the model's profile, 'fit' also its bf16 copy's (compiled unless --eager)")
    ap.add_argument("--dynamo-reset", action="store_true", help="torch._dynamo.reset() after --profile-first")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a subprocess's own case
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args)))
        return
    known = PLAN_VARIANTS if args.plan else CASES
    if args.plan and args.cases == ",".join(CASES):
        args.cases = ",".join(PLAN_VARIANTS)
    unknown = [c for c in args.cases.split(",") if c not in known]
    if unknown:
        raise SystemExit(f"hf_compiled_policies: unknown case(s) {unknown}; known: {', '.join(known)}")
    passed = ["--weights", args.weights, "--layers", str(args.layers), "--cap", str(args.cap)]
    passed += ["--plan", args.plan] if args.plan else []
    passed += ["--profile-first", args.profile_first] + ["--dynamo-reset"] * args.dynamo_reset
    passed += [flag for flag, on in (("--host", args.host), ("--eager", args.eager), ("--tiny", args.tiny)) if on]
    how = ("eager" if args.eager else "compiled") + (f", capped at {args.cap:g} GiB" if args.cap else "")
    print(f"| case | weights | host | {how} |")
    print("|---|---|---|---|")
    for case in args.cases.split(","):
        env = dict(os.environ)
        if args.cap:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        r = subprocess.run([sys.executable, __file__, *passed, "--one", case], capture_output=True, text=True,
                           timeout=300, env=env)
        if r.returncode == 0:
            got = json.loads(r.stdout.strip().splitlines()[-1])["losses"]
        else:
            lines = r.stderr.strip().splitlines()
            frames = [ln.strip() for ln in lines if ln.strip().startswith("File ") and
                      ("elbowroom" in ln or "/torch/" in ln)]
            err = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
            got = f"rc {r.returncode}: {err[:160]} (at {frames[-1][:160] if frames else '?'})"
        weights, host = ("plan's", "plan's") if args.plan else (args.weights, args.host)
        print(f"| {case} | {weights} | {host} | {got} |", flush=True)


if __name__ == "__main__":
    main()
