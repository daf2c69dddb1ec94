"""``elbowroom.fit`` on Hugging Face causal LMs built from a config (nothing downloaded), in a plain torch loop:
plain AdamW first, then ``fit`` at each budget, each row with the plan's predictions beside the measurement.

    python3 benchmarks/hf_fit.py --arch llama --budgets 16GiB,10GiB --json runs/hf.jsonl
    python3 benchmarks/hf_fit.py --arch gpt2 --budgets 12GiB,8GiB                      # dropout on
    python3 benchmarks/hf_fit.py --arch llama --budgets 16GiB --compile   # fit(compile=True), and plain compiled too

The loop is the one a user writes for a Hugging Face model (``model(**batch).loss``, ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad()``), under bf16 autocast; ``fit`` is the only change. Each row runs in
this process after the previous one's model and optimizer are freed (a fresh model, the same seed), and caps the
allocator at the budget (``torch.cuda.set_per_process_memory_fraction``), as on a card of that size. The shapes:
``llama`` is TinyLlama-1.1B's (22 layers of 2048, grouped-query attention, SwiGLU 5632), ``gpt2`` is GPT-2-large's
(36 layers of 1280, dropout 0.1 everywhere); ``--tiny`` shrinks either to run on CPU in seconds.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(arch: str, tiny: bool, device: torch.device) -> torch.nn.Module:
    """A transformers causal LM of ``arch`` from its config, fp32, on ``device``, seeded."""
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        kw = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
        if tiny:
            kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
        cfg = transformers.LlamaConfig(**kw, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(cfg).to(device)
    if arch == "gpt2":
        kw = dict(n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, n_positions=1024)
        if tiny:
            kw.update(n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=128)
        cfg = transformers.GPT2Config(**kw, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(cfg).to(device)
    raise SystemExit(f"hf_fit: --arch is llama or gpt2, got {arch!r}")


def run(arch: str, budget: str | None, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One row: plain AdamW (``budget`` None) or ``fit`` at ``budget``; the step time over the timed steps, run
    back to back."""
    from elbowroom.plan import fit

    model = build(arch, args.tiny, device)
    model.config.use_cache = False  # training: no KV cache (compiled blocks would recompile for one)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=device)
    batch = {"input_ids": ids, "labels": ids}
    mode = (budget or "plain") + ("+compile" if args.compile else "")
    row: dict[str, Any] = {"workload": f"hf-{arch}{'-tiny' if args.tiny else ''}", "mode": mode,
                           "batch": f"{args.batch}x{args.seq}", "params_M": sum(p.numel() for p in model.parameters())
                           // 10**6}
    t0 = time.perf_counter()
    if budget is None:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        plan = None
        if args.compile:  # the reference for compiled plans: the same blocks compiled the same way
            from elbowroom import compile_blocks

            compile_blocks(model)
    else:
        extra: dict[str, Any] = {}
        if args.trace_steps:
            from elbowroom.optim import CPUOffloadConfig

            extra["offload_config"] = CPUOffloadConfig(trace_steps=True)
        model, opt, plan = fit(model, batch, budget=budget, precision="bf16", grad_clipping=False, lr=1e-4,
                               fused=device.type == "cuda", stream=False if args.no_stream else None,
                               compile=args.compile, **extra)
        row["plan_seconds"] = round(time.perf_counter() - t0, 1)
        if args.save_plans:  # before the first step: a plan whose run faults is kept
            Path(args.save_plans).mkdir(parents=True, exist_ok=True)
            plan.save(Path(args.save_plans) / f"{row['workload']}-{mode.replace('+', '-')}.toml")
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if plan is not None and not args.no_cap:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, plan.budget_bytes / total))
        torch.cuda.reset_peak_memory_stats()
    # bf16 weights (a plan's choice) run as they are; fp32 ones under autocast, as the profile ran them
    bf16 = plan is not None and plan.weight_dtype == "bfloat16"
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not bf16)
    from bench import _drain  # (this script's folder is on the path when it runs)

    times, losses = [], []
    tracer = None
    t_timed = t_end = None
    try:
        for i in range(args.steps):
            # the timed steps run back to back, as in a training loop (and bench.py): no device sync between them,
            # so that a lazy optimizer's copies and streamed states overlap the next step as they do in a real run
            # (the twenty-second session's 10 GiB row, every step between two syncs, ran at 0.47x its prediction:
            # work the optimizer's threads enqueued after a step's closing sync was timed nowhere)
            synced = i <= args.warmup
            if args.trace and cuda and i == args.steps - 1:  # the last step under the profiler, after the window
                t_end = _drain(opt)
            if synced and cuda:
                torch.cuda.synchronize()
            if i == args.warmup:
                t_timed = time.perf_counter()
            if args.trace and cuda and i == args.steps - 1:
                tracer = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])
                tracer.__enter__()
            t = time.perf_counter()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []
            if marks:
                marks[0].record()
            with amp:
                loss = model(**batch).loss
            loss.backward()
            if marks:
                marks[1].record()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if marks:
                marks[2].record()
            losses.append(loss.detach().item())  # (as a user's loop reads it: a sync up to the loss)
            times.append(time.perf_counter() - t)
        if t_end is None:
            t_end = _drain(opt)
        if marks:  # the last step's GPU time of forward + backward (with any wait of the forward for the host step)
            row["gpu_ms"] = [round(marks[0].elapsed_time(marks[1]), 1), round(marks[1].elapsed_time(marks[2]), 1)]
        if tracer is not None:
            tracer.__exit__(None, None, None)
            from bench import _write_trace

            _write_trace(tracer, Path(args.trace) / f"{row['workload']}-{row['mode']}.json.gz")
    except torch.OutOfMemoryError as e:
        row["error"] = "OOM: " + (str(e).splitlines() or [""])[0][:300]
    timed = times[args.warmup : len(times) - (tracer is not None)]  # not the traced step: the profiler slows it
    if timed and t_timed is not None and t_end is not None:
        step = (t_end - t_timed) / len(timed)  # the window, drained of the last step's host work
        row["loop_step_s"] = round(statistics.median(timed), 4)  # the loop's own pace, without that drain
        row.update(step_s=round(step, 4), tok_per_s=round(args.batch * args.seq / step), loss_first=round(losses[0], 4),
                   loss_last=round(losses[-1], 4))
    if cuda:
        row.update(peak_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   reserved_peak_GiB=round(torch.cuda.max_memory_reserved() / 2**30, 2))
    if plan is not None:
        row.update(pred_step_s=round(plan.predicted_step_seconds, 4),
                   pred_peak_GiB=round(plan.predicted_peak_bytes / 2**30, 2),
                   plan={"weights": plan.weight_dtype, "micro_batch": plan.micro_batch,
                         "optimizer_on_host": len(plan.optimizer_offload_blocks),
                         "optimizer_streamed": len(plan.optimizer_stream_blocks),
                         "blocks": sorted({b.policy_label for b in plan.blocks})},
                   settings={"mechanism": {"plan": plan.to_dict()}})
        if "step_s" in row:
            row["step_vs_pred"] = round(row["step_s"] / row["pred_step_s"], 3)
        if "reserved_peak_GiB" in row:
            row["peak_vs_pred"] = round(row["reserved_peak_GiB"] / row["pred_peak_GiB"], 3)
    if hasattr(opt, "stats") and opt.stats().get("offloaded_params"):
        st = opt.stats()  # the last step's host optimizer work and how long the forward waited for it
        row.update(host_step_s=round(float(st["cpu_step_s"]), 4), host_wait_s=round(float(st["cpu_wait_s"]), 4))
        if st.get("trace"):  # --trace-steps: the last step's host timeline, summed by kind of event
            kinds: dict[str, list[float]] = {}
            for what, _, a, b in st["trace"]:
                k = kinds.setdefault(what, [0, 0.0, math.inf, -math.inf])
                k[0] += 1
                k[1] += b - a
                k[2], k[3] = min(k[2], a), max(k[3], b)
            row["host_trace"] = {w: {"n": n, "busy_s": round(t, 4), "first_s": round(a, 4), "last_s": round(b, 4)}
                                 for w, (n, t, a, b) in kinds.items()}
    if hasattr(opt, "close"):
        opt.close()
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="llama", choices=["llama", "gpt2"])
    ap.add_argument("--budgets", default="16GiB,10GiB", help="comma-separated budgets for fit (plain runs first)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4 llama, 8 gpt2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048 llama, 1024 gpt2)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a small config that runs on CPU")
    ap.add_argument("--no-stream", action="store_true", help="fit(stream=False): no block streams its optimizer state")
    ap.add_argument("--no-plain", action="store_true", help="only the fit rows (no plain AdamW row first)")
    ap.add_argument("--compile", action="store_true",
                    help="fit(compile=True): the blocks compiled in place and the plans priced on them so; the plain "
                         "row compiles its blocks the same way (run without the flag for eager plain)")
    ap.add_argument("--json", help="append each row to this JSONL file")
    ap.add_argument("--trace", default=None, help="write the last step's profiler trace (gzipped Chrome JSON) here; "
                    "its time is left out of the median by --steps > warm-up + 1")
    ap.add_argument("--trace-steps", action="store_true",
                    help="record the offloaded optimizer's host timeline (CPUOffloadConfig.trace_steps) in each row")
    ap.add_argument("--save-plans", default=None,
                    help="save each fit's plan (TOML) in this folder before its first step")
    ap.add_argument("--no-cap", action="store_true", help="leave the allocator uncapped (a diagnostic: the fit rows "
                    "then hold their budget only as planned)")
    ap.add_argument("--no-donate", action="store_true", help="torch._functorch.config.donated_buffer = False: the "
                    "compiled backward writes no intermediate into the tensors saved for it (a diagnostic)")
    ap.add_argument("--dynamo-reset", action="store_true", help="torch._dynamo.reset() inside fit, after its "
                    "profiles and before it applies the plan (a diagnostic: no compiled code of the profiles reused)")
    args = ap.parse_args()
    if args.dynamo_reset:
        import elbowroom.plan.search as search  # (fit imports plan_for from here when it runs)

        plan_for = search.plan_for

        def reset_then_plan(*a: Any, **k: Any) -> Any:  # fit plans once, between its profiles and apply
            torch._dynamo.reset()
            return plan_for(*a, **k)

        search.plan_for = reset_then_plan
    if args.no_donate:
        importlib.import_module("torch._functorch.config").donated_buffer = False
    if args.batch is None:
        args.batch = 2 if args.tiny else (4 if args.arch == "llama" else 8)
    if args.seq is None:
        args.seq = 32 if args.tiny else (2048 if args.arch == "llama" else 1024)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if os.environ.get("ELBOWROOM_BENCH_NON_REENTRANT"):
        from bench import non_reentrant_recompute

        non_reentrant_recompute()
    budgets: list[str | None] = [None] * (not args.no_plain) + [b for b in args.budgets.split(",") if b]
    plain = None
    print("| model | mode | tok/s | % of plain | peak / reserved GiB | predicted GiB | step s | predicted s | "
          "step / pred | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    from elbowroom.plan import BudgetError

    for budget in budgets:
        try:
            row = run(args.arch, budget, args, device)
        except BudgetError as e:  # the refusal is the row's result: the next budgets still run
            row = {"workload": f"hf-{args.arch}{'-tiny' if args.tiny else ''}", "mode": budget,
                   "error": f"BudgetError: {e}"}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if budget is None:
            plain = row.get("tok_per_s")
        pct = f"{100 * row['tok_per_s'] / plain:.1f}" if plain and row.get("tok_per_s") else ""
        print(f"| {row['workload']} | {row['mode']} | {row.get('tok_per_s', row.get('error', ''))} | {pct} | "
              f"{row.get('peak_GiB')} / {row.get('reserved_peak_GiB')} | {row.get('pred_peak_GiB', '')} | "
              f"{row.get('step_s', '')} | {row.get('pred_step_s', '')} | {row.get('step_vs_pred', '')} | "
              f"{row.get('plan', '')} |", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
