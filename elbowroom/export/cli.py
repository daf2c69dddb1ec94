"""``elbowroom export hf|onnx|quantize|prune RUN_DIR_OR_CHECKPOINT --out PATH``.

Every export reads the newest checkpoint that verifies (or the one named), writes into a temporary
directory beside ``--out`` and renames it into place at the end, with an ``export.json`` report: the
validation loss before and after on the run's own validation split (where the export changes the
numbers), the delta, and the bytes on disk. Bad input (a checkpoint that does not verify, an unknown
architecture, an option this machine cannot do, a missing extra) prints one line and exits with code 2,
writing nothing at ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

from elbowroom.export.source import ExportError, Source, dir_size, load_source, staged_output, validation_batches

__all__ = ["cmd_export", "build_parser"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    """The ``elbowroom export`` argument parser (one sub-command per export)."""
    parser = argparse.ArgumentParser(prog="elbowroom export", description="Export a trained model.")
    sub = parser.add_subparsers(dest="what", required=True, metavar="{hf,onnx,quantize,prune}")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                       help="a run directory (its newest valid checkpoint) or a checkpoint directory step_NNNNNNNN")
        p.add_argument("--out", required=True, help="output directory (must not exist; written atomically)")
        p.add_argument("--cache-dir", default=None, help="where the built-in corpus is cached (for the validation "
                       "loss; default ~/.cache/elbowroom, or $ELBOWROOM_CACHE)")
        return p

    p = add("hf", "a transformers directory (LlamaForCausalLM / GPT2LMHeadModel, safetensors)")
    p.add_argument("--max-shard-size", default="5GB", help="largest weight file before sharding (default 5GB)")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="weight dtype in the files")
    p = add("onnx", "an ONNX file (dynamic batch and sequence), checked and run in ONNX Runtime")
    p.add_argument("--int8", action="store_true", help="also write model.int8.onnx (ORT dynamic int8)")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (torch's default when left out)")
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches (default: the run's)")
    from elbowroom.export.quantize import METHODS as QUANT

    p = add("quantize", "torchao quantisation, with the validation loss delta")
    p.add_argument("--method", required=True, choices=(*QUANT, "qat"),
                   help="quantisation recipe; qat: convert a --train.qat run with its own scheme")
    p.add_argument("--calibration-batches", type=int, default=4, help="int8-static: validation batches observed")
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches (default: the run's)")
    from elbowroom.export.prune import METHODS as PRUNE

    p = add("prune", "magnitude pruning, made permanent; writes a checkpoint directory")
    p.add_argument("--method", required=True, choices=PRUNE, help="l1 (unstructured), channel, or 2:4")
    p.add_argument("--amount", type=float, default=0.5, help="fraction pruned in (0, 1) (default 0.5; 2:4 prunes "
                   "exactly 0.5 and refuses another amount)")
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches (default: the run's)")
    return parser


def _loss(model: Any, batches: list[dict[str, Any]], device: str = "cpu") -> float | None:
    from elbowroom.export.source import validation_loss

    return validation_loss(model, batches, device) if batches else None


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def _export_hf(src: Source, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from elbowroom.export.hf import parse_size, save_hf

    limit = parse_size(args.max_shard_size)
    if src.hf is not None:  # a --model.hf run: the model in its own format, as from_pretrained reads it
        model = copy.deepcopy(src.hf).to(_DTYPES[args.dtype])
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=limit)
        files = sorted(tmp.glob("*.safetensors"))
        return {"files": [f.name for f in files], "size_bytes": sum(f.stat().st_size for f in files)}
    files = save_hf(src.model, src.config, tmp, max_shard_size=limit, dtype=_DTYPES[args.dtype])
    report = {"files": [f.name for f in files], "size_bytes": sum(f.stat().st_size for f in files)}
    return {**report, **_qat_note(src)}


def _qat_note(src: Source) -> dict[str, Any]:
    """What an export of a --train.qat run's float weights should say."""
    from elbowroom.export.qat import run_scheme

    scheme = run_scheme(src.meta)
    if scheme is None:
        return {}
    return {"qat": scheme, "note": f"the float weights of a --train.qat {scheme} run; `elbowroom export quantize "
            f"{src.path} --method qat` gives the model it was trained to be"}


def _export_onnx(src: Source, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from elbowroom.export.onnx_export import export_onnx, quantize_onnx_int8, run_onnx

    path = export_onnx(src.model, tmp / "model.onnx", opset_version=args.opset)
    batches = validation_batches(src, args.eval_batches, cache_dir=args.cache_dir)
    before = _loss(src.model, batches)
    after = _loss(run_onnx(path), batches)
    # the weights live beside the graph, in model.onnx.data (ONNX files stop at 2 GB)
    size = sum(dir_size(f) for f in tmp.glob("model.onnx*"))
    report: dict[str, Any] = {"val_loss_before": before, "val_loss_after": after, "loss_delta": _delta(before, after),
                              "size_bytes": size}
    if args.int8:
        q = quantize_onnx_int8(path, tmp / "model.int8.onnx")
        after8 = _loss(run_onnx(q), batches)
        size8 = sum(dir_size(f) for f in tmp.glob("model.int8.onnx*"))
        report.update(int8_val_loss=after8, int8_loss_delta=_delta(before, after8), int8_size_bytes=size8)
    return report


def _export_quantize(src: Source, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from elbowroom.export.quantize import quantize_model, save_quantized

    if args.method == "qat":
        return _export_qat(src, args, tmp)
    batches = validation_batches(src, args.eval_batches, cache_dir=args.cache_dir)
    calibration = [b["input_ids"] for b in validation_batches(src, args.calibration_batches, cache_dir=args.cache_dir)]
    before = _loss(src.model, batches)
    device = "cuda" if args.method == "float8" else "cpu"
    qmodel = quantize_model(copy.deepcopy(src.model), args.method, calibration=calibration, device=device)
    after = _loss(qmodel, batches, device)
    example = torch.randint(0, src.config.vocab_size, (2, min(16, src.config.max_seq_len)), device=device)
    path = save_quantized(qmodel, src.config, args.method, tmp, example)
    return {"method": args.method, "val_loss_before": before, "val_loss_after": after,
            "loss_delta": _delta(before, after), "size_bytes": dir_size(path),
            "fp32_size_bytes": sum(p.numel() * 4 for p in src.model.state_dict().values()), **_qat_note(src)}


def _export_qat(src: Source, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A --train.qat run converted with its own scheme: the quantised model computes what training saw."""
    from elbowroom.export.qat import convert_qat, load_trained, run_scheme
    from elbowroom.export.quantize import save_quantized

    batches = validation_batches(src, args.eval_batches, cache_dir=args.cache_dir)
    before = _loss(src.model, batches)
    fake = load_trained(src)
    trained = _loss(fake, batches)
    qmodel = convert_qat(fake)
    after = _loss(qmodel, batches)
    example = torch.randint(0, src.config.vocab_size, (2, min(16, src.config.max_seq_len)))
    path = save_quantized(qmodel, src.config, "qat", tmp, example)
    return {"method": "qat", "qat": run_scheme(src.meta), "val_loss_before": before,
            "val_loss_fake_quant": trained, "val_loss_after": after, "loss_delta": _delta(before, after),
            "size_bytes": dir_size(path),
            "fp32_size_bytes": sum(p.numel() * 4 for p in src.model.state_dict().values())}


def _export_prune(src: Source, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from elbowroom.export.prune import prune_model
    from elbowroom.train.checkpoint import CheckpointManager

    batches = validation_batches(src, args.eval_batches, cache_dir=args.cache_dir)
    before = _loss(src.model, batches)
    model = copy.deepcopy(src.model)
    stats = prune_model(model, args.method, args.amount)
    after = _loss(model, batches)
    info = {"method": args.method, "amount": args.amount, **stats}
    meta = {"model": src.config.to_dict(), "pruning": info}
    if isinstance(src.meta.get("config"), dict):
        meta["config"] = src.meta["config"]  # keeps the validation split findable for a later export
    # the same layout as a training checkpoint (checksummed), so `elbowroom export hf OUT` reads it back
    written = CheckpointManager(tmp / ".checkpoint").save(src.step, {"model": model.state_dict()}, meta)
    for f in ("state.pt", "meta.json"):
        (written / f).rename(tmp / f)
    for d in (written, written.parent):
        d.rmdir()
    return {**info, "val_loss_before": before, "val_loss_after": after, "loss_delta": _delta(before, after),
            "size_bytes": dir_size(tmp / "state.pt")}


_EXPORTS = {"hf": _export_hf, "onnx": _export_onnx, "quantize": _export_quantize, "prune": _export_prune}


def _preflight(args: argparse.Namespace) -> None:
    """Checks that need no model: the options this machine cannot do, before anything is read or written."""
    if args.what == "quantize" and args.method == "float8":
        from elbowroom.export.quantize import check_float8

        check_float8(None)
    if args.what == "hf":
        from elbowroom.export.hf import parse_size

        parse_size(args.max_shard_size)
    if args.what == "prune":
        from elbowroom.export.prune import check_amount

        check_amount(args.method, args.amount)


def run_export(args: argparse.Namespace) -> dict[str, Any]:
    """Do the export that parsed ``args`` ask for; returns the report also written to ``OUT/export.json``.

    Raises:
        ExportError: bad input; nothing has been written at ``args.out``.
    """
    _preflight(args)
    src = load_source(args.source)
    if src.hf is not None and args.what != "hf":
        raise ExportError(f"{src.path} holds a Hugging Face model (a --model.hf run): `elbowroom export hf` writes it "
                          f"back in its own format; export {args.what} works on elbowroom's own models (llama, gpt2)")
    arch = src.config.arch if src.config is not None else f"hf:{getattr(src.hf.config, 'model_type', '?')}"
    with staged_output(args.out) as tmp:
        report = {"export": args.what, "source": str(src.path), "step": src.step, "arch": arch,
                  **_EXPORTS[args.what](src, args, tmp)}
        (tmp / "export.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def cmd_export(argv: list[str]) -> int:
    """Entry point of ``elbowroom export``: parse ``argv`` (after the word ``export``), export, report.

    Returns:
        0 on success, 2 on bad input (one line on stderr, nothing written at ``--out``).
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its usage line already
        return int(e.code or 0) if isinstance(e.code, int) else 2
    try:
        report = run_export(args)
    except ExportError as e:
        print(f"elbowroom export: error: {e}", file=sys.stderr)
        return 2
    parts = [f"{args.what} -> {args.out}", f"{report['size_bytes']:,} bytes"]
    if report.get("loss_delta") is not None:
        parts.append(f"val loss {report['val_loss_before']:.4f} -> {report['val_loss_after']:.4f} "
                     f"({report['loss_delta']:+.4f})")
    if "sparsity" in report:
        parts.append(f"sparsity {report['sparsity']:.4f}")
    if "note" in report:
        parts.append(report["note"])
    print("; ".join(parts))
    return 0
