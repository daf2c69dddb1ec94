"""elbowroom.export: each export against the model it came from, on runs trained here for a few steps."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elbowroom.export.cli import cmd_export
from elbowroom.export.source import load_source, validation_batches

EXTRAS = ("torchao", "onnx", "onnxscript", "onnxruntime", "safetensors", "transformers")


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


needs = {m: pytest.mark.skipif(not _have(m), reason=f"{m} is not installed (pip install 'elbowroom[export]')")
         for m in EXTRAS}


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A llama run and a gpt2 run of the tiny model, 5 steps each on the built-in corpus."""
    from elbowroom.cli import main

    out = {}
    for arch in ("llama", "gpt2"):
        run = tmp_path_factory.mktemp(f"run-{arch}") / "run"
        rc = main(["train", "--out", str(run), "--steps", "5", "--data.num_workers", "0", "--model.arch", arch,
                   "--train.device", "cpu", "--train.eval_batches", "1"])
        assert rc in (0, None)
        out[arch] = run
    return out


@pytest.fixture(scope="session")
def llama(runs):
    return load_source(runs["llama"])


@pytest.fixture(scope="session")
def batch(llama) -> torch.Tensor:
    """Two validation sequences of the llama run."""
    return validation_batches(llama, 1)[0]["input_ids"][:2]


def _report(out: Path) -> dict:
    return json.loads((out / "export.json").read_text())


def test_importing_export_imports_no_extra():
    code = ("import sys, elbowroom, elbowroom.export, elbowroom.export.cli, elbowroom.export.quantize, "
            "elbowroom.export.distill, elbowroom.export.qat, elbowroom.export.hf; "
            f"print([m for m in {EXTRAS!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------------- hf


@needs["transformers"]
@needs["safetensors"]
@pytest.mark.parametrize("arch, cls", [("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel")])
def test_hf_logits_equal_ours(runs, tmp_path, arch, cls):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    assert cmd_export(["hf", str(runs[arch]), "--out", str(out), "--max-shard-size", "1MB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())  # 3.7 MB of fp32 weights: sharded
    assert len(set(index["weight_map"].values())) > 1
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == cls
    src = load_source(runs[arch])
    ids = torch.randint(0, src.config.vocab_size, (2, 37))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, src.model(ids), atol=1e-4, rtol=0)


@needs["transformers"]
@needs["safetensors"]
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_tied_and_unfused_weights(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from elbowroom.export.hf import save_hf
    from elbowroom.models import ModelConfig, build_model

    cfg = ModelConfig(arch=arch, tie_embeddings=True, fused_qkv=False, n_layers=2)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # away from the init, so a wrong layout cannot hide behind small weights
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    files = save_hf(model, cfg, tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.get_output_embeddings().weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    ids = torch.randint(0, cfg.vocab_size, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------- onnx


@needs["onnx"]
@needs["onnxscript"]
@needs["onnxruntime"]
def test_onnx_runtime_matches_torch_at_two_shapes(runs, llama, tmp_path):
    import onnx

    from elbowroom.export.onnx_export import run_onnx

    out = tmp_path / "onnx"
    assert cmd_export(["onnx", str(runs["llama"]), "--out", str(out), "--int8", "--eval-batches", "1"]) == 0
    onnx.checker.check_model(str(out / "model.onnx"))
    run = run_onnx(out / "model.onnx")
    for shape in [(2, 16), (3, 41)]:
        ids = torch.randint(0, llama.config.vocab_size, shape)
        with torch.no_grad():
            torch.testing.assert_close(run(ids), llama.model(ids), atol=1e-4, rtol=0)
    report = _report(out)
    assert abs(report["loss_delta"]) < 1e-4
    assert abs(report["int8_loss_delta"]) < 0.05
    assert report["int8_size_bytes"] < report["size_bytes"] / 2


# --------------------------------------------------------------------------------------------- quantize


@needs["torchao"]
@pytest.mark.parametrize("method, min_db", [("int8-dynamic", 35.0), ("int8-weight", 35.0), ("int4-weight", 20.0)])
def test_quantized_sqnr(llama, batch, method, min_db):
    import copy

    from elbowroom.export.quantize import quantize_model, sqnr

    with torch.no_grad():
        ref = llama.model(batch)
        out = quantize_model(copy.deepcopy(llama.model), method)(batch)
    assert sqnr(ref, out) >= min_db


@needs["torchao"]
def test_quantize_cli_writes_a_reloadable_model(runs, llama, batch, tmp_path):
    from elbowroom.export.quantize import load_quantized, quantize_model

    out = tmp_path / "q"
    assert cmd_export(["quantize", str(runs["llama"]), "--out", str(out), "--method", "int8-dynamic",
                       "--eval-batches", "1"]) == 0
    report = _report(out)
    assert abs(report["loss_delta"]) < 0.01
    assert report["size_bytes"] < report["fp32_size_bytes"] / 2
    import copy

    with torch.no_grad():
        expected = quantize_model(copy.deepcopy(llama.model), "int8-dynamic")(batch)
        torch.testing.assert_close(load_quantized(out)(batch), expected)


@needs["torchao"]
def test_static_int8_calibrates_on_the_validation_split(runs, llama, batch, tmp_path):
    from elbowroom.export.quantize import load_quantized, sqnr

    out = tmp_path / "static"
    assert cmd_export(["quantize", str(runs["llama"]), "--out", str(out), "--method", "int8-static",
                       "--calibration-batches", "1", "--eval-batches", "1"]) == 0
    assert abs(_report(out)["loss_delta"]) < 0.01
    with torch.no_grad():
        assert sqnr(llama.model(batch), load_quantized(out)(batch)) >= 30.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusal")
def test_float8_on_cpu_exits_2_and_writes_nothing(runs, tmp_path, capsys):
    out = tmp_path / "f8"
    assert cmd_export(["quantize", str(runs["llama"]), "--out", str(out), "--method", "float8"]) == 2
    assert "float8 needs a CUDA GPU" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ prune


@pytest.mark.parametrize("method, amount", [("l1", 0.3), ("channel", 0.25), ("2:4", 0.5)])
def test_prune_sparsity_is_exact(llama, method, amount):
    import copy

    from elbowroom.export.prune import prunable, prune_model

    model = copy.deepcopy(llama.model)
    stats = prune_model(model, method, amount)
    layers = [m for _, m in prunable(model)]
    if method == "l1":
        expected = sum(round(amount * m.weight.numel()) for m in layers)
    elif method == "channel":
        expected = sum(round(amount * m.out_features) * m.in_features for m in layers)
        for m in layers:  # whole rows
            rows = (m.weight == 0).all(dim=1)
            assert int(rows.sum()) == round(amount * m.out_features)
    else:
        expected = sum(m.weight.numel() // 2 for m in layers)
        for m in layers:  # exactly 2 of every 4
            assert ((m.weight.reshape(m.out_features, -1, 4) != 0).sum(-1) == 2).all()
    assert stats["zeros"] == expected
    assert stats["sparsity"] == expected / sum(m.weight.numel() for m in layers)
    assert not any(hasattr(m, "weight_orig") for m in layers)  # made permanent


@pytest.mark.parametrize("amount", ["0.9", "0.25"])
def test_two_four_refuses_an_amount_it_would_ignore(runs, tmp_path, capsys, amount):
    """2:4 prunes exactly half: another --amount exits 2 with the fix, before any model is read, writing nothing."""
    out = tmp_path / "pruned"
    assert cmd_export(["prune", str(runs["llama"]), "--out", str(out), "--method", "2:4", "--amount", amount]) == 2
    err = capsys.readouterr().err
    assert f"its amount is fixed at 0.5 (50%), got --amount {amount}; drop --amount" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
    from elbowroom.export.prune import prune_model

    with pytest.raises(ValueError, match="fixed at 0.5"):  # the library refuses it too
        prune_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), "2:4", float(amount))


def test_pruned_checkpoint_reloads(runs, tmp_path):
    out = tmp_path / "pruned"
    assert cmd_export(["prune", str(runs["llama"]), "--out", str(out), "--method", "l1", "--amount", "0.5",
                       "--eval-batches", "1"]) == 0
    report = _report(out)
    assert report["sparsity"] == pytest.approx(0.5, abs=1e-6)
    assert report["val_loss_after"] > report["val_loss_before"] - 1e-3
    back = load_source(out)  # checksummed like a training checkpoint
    from elbowroom.export.prune import sparsity

    assert sparsity(back.model)["zeros"] == report["zeros"]
    assert validation_batches(back, 1)  # the run config travelled with it


# -------------------------------------------------------------------------------------------------- QAT


@needs["torchao"]
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_qat_convert_equals_fake_quant(llama, batch, scheme):
    import copy

    from elbowroom.export.qat import convert_qat, prepare_qat

    model = prepare_qat(copy.deepcopy(llama.model), scheme)
    with torch.no_grad():
        fake = model(batch)
        real = convert_qat(model)(batch)
    torch.testing.assert_close(real, fake, atol=1e-5, rtol=1e-5)


@needs["torchao"]
def test_qat_loss_falls(llama, batch):
    import copy

    import torch.nn.functional as F

    from elbowroom.export.qat import prepare_qat

    torch.manual_seed(0)
    model = prepare_qat(copy.deepcopy(llama.model), "int4").train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


# ------------------------------------------------------------------------------------------ distillation


def _student(seed: int = 0, n: int = 50, d: int = 16, vocab: int = 40):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n // 2, d, generator=g, requires_grad=True)
    w = torch.randn(vocab, d, generator=g, requires_grad=True)
    t = torch.randn(2, n // 2, vocab, generator=g) * 2
    y = torch.randint(0, vocab, (2, n // 2), generator=g)
    y[0, :3] = -100
    return h, w, t, y


def test_distillation_kl_of_a_distribution_with_itself_is_zero():
    from elbowroom.export.distill import distillation_loss

    h, w, _, y = _student()
    same = (h @ w.t()).detach()
    assert distillation_loss(h, w, same, y, ratio=1.0, temperature=2.0).item() == pytest.approx(0.0, abs=1e-6)
    ce = torch.nn.functional.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten())
    torch.testing.assert_close(distillation_loss(h, w, same, y, ratio=0.3), 0.7 * ce)


def test_distillation_chunked_equals_unchunked_and_the_formula():
    import torch.nn.functional as F

    from elbowroom.export.distill import distillation_loss

    h, w, t, y = _student()
    a, T = 0.4, 1.7
    logits = (h @ w.t()).flatten(0, 1)
    valid = y.flatten() != -100
    kl = F.kl_div(F.log_softmax(logits / T, -1), F.log_softmax(t.flatten(0, 1) / T, -1), log_target=True,
                  reduction="none").sum(-1)
    ref = (1 - a) * F.cross_entropy(logits, y.flatten()) + a * T**2 * kl[valid].mean()
    ref_grads = torch.autograd.grad(ref, (h, w))
    for chunk in (7, 4096):
        loss = distillation_loss(h, w, t, y, a, T, chunk_tokens=chunk)
        torch.testing.assert_close(loss, ref)
        for got, want in zip(torch.autograd.grad(loss, (h, w)), ref_grads):
            torch.testing.assert_close(got, want)


@needs["transformers"]
@needs["safetensors"]
def test_teacher_is_frozen_and_loads_from_either_format(runs, llama, batch, tmp_path):
    from elbowroom.export.distill import distillation_loss, load_teacher
    from elbowroom.models import build_model

    teacher = load_teacher(runs["llama"])
    student = build_model(llama.config)
    x, y = batch[:, :-1], batch[:, 1:]
    loss = distillation_loss(student.hidden_states(x), student.output.weight, teacher.logits_fn(x), y,
                             ratio=0.5, temperature=2.0, chunk_tokens=100)
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters())
    hf_dir = tmp_path / "hf"
    assert cmd_export(["hf", str(runs["llama"]), "--out", str(hf_dir)]) == 0
    hf_teacher = load_teacher(hf_dir, dtype=torch.bfloat16)
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in hf_teacher.parameters())
    torch.testing.assert_close(hf_teacher(x).float(), teacher(x), atol=0.1, rtol=0.05)


# --------------------------------------------------------------------------------------------- bad input


def _copy_run(runs, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(runs["llama"], run)
    return run


def test_corrupt_checkpoint_exits_2_and_writes_nothing(runs, tmp_path, capsys):
    run = _copy_run(runs, tmp_path)
    (ckpt,) = (run / "checkpoints").iterdir()
    with open(ckpt / "state.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\x00corrupt\x00")
    out = tmp_path / "out"
    assert cmd_export(["hf", str(ckpt), "--out", str(out)]) == 2
    assert "does not verify" in capsys.readouterr().err
    assert cmd_export(["hf", str(run), "--out", str(out)]) == 2  # the run has no other checkpoint
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_unknown_architecture_exits_2(runs, tmp_path, capsys):
    run = _copy_run(runs, tmp_path)
    (ckpt,) = (run / "checkpoints").iterdir()
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["model"]["arch"] = "mamba"
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert cmd_export(["onnx", str(run), "--out", str(tmp_path / "out")]) == 2
    assert "unknown model architecture 'mamba'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_existing_out_and_missing_extra_exit_2(runs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    assert cmd_export(["hf", str(runs["llama"]), "--out", str(out)]) == 2
    assert list(out.iterdir()) == []
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert cmd_export(["hf", str(runs["llama"]), "--out", str(tmp_path / "hf")]) == 2
    assert "pip install 'elbowroom[export]'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@needs["transformers"]
@needs["safetensors"]
def test_export_from_a_sharded_checkpoint(runs, llama, tmp_path, capsys):
    # a run on several processes saves torch.distributed.checkpoint shards; export reads them in one process
    from transformers import AutoModelForCausalLM

    from elbowroom.train.checkpoint import CheckpointManager
    from elbowroom.train.sharded_checkpoint import save_sharded

    run = tmp_path / "sharded-run"
    model = llama.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = {k: v for k, v in llama.meta.items() if k not in ("step", "sha256", "size", "format", "files")}
    save_sharded(CheckpointManager(run / "checkpoints"), llama.step, model, opt, {"samples_seen": 0}, meta,
                 is_main=True)
    again = load_source(run)
    assert again.path.name == llama.path.name
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.model.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    out = tmp_path / "hf"
    assert cmd_export(["hf", str(run), "--out", str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, llama.config.vocab_size, (2, 29))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)
    # a flipped byte in a shard: the checkpoint does not verify, exit 2, nothing written
    shard = next(f for f in sorted(again.path.iterdir()) if f.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = tmp_path / "hf-bad"
    assert cmd_export(["hf", str(again.path), "--out", str(bad)]) == 2
    assert not bad.exists() and "does not verify" in capsys.readouterr().err


@pytest.mark.skipif(not _have("transformers") or not _have("safetensors"), reason="needs the hf extra")
def test_a_hugging_face_run_exports_in_its_own_format(tmp_path, capsys):
    """A --model.hf run's checkpoint holds the Hugging Face model's own state_dict: `export hf` writes it back as
    from_pretrained reads it (the same logits); the exports of elbowroom's own models refuse it, writing nothing."""
    import transformers

    from elbowroom.cli import main

    src_dir = tmp_path / "hf-src"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(src_dir)
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--model.hf", str(src_dir), "--steps", "3", "--data.seq_len", "32",
                 "--data.num_workers", "0", "--train.device", "cpu", "--train.eval_batches", "1"]) in (0, None)
    out = tmp_path / "out"
    assert cmd_export(["hf", str(run), "--out", str(out)]) == 0
    assert _report(out)["arch"] == "hf:llama" and (out / "model.safetensors").is_file()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    trained = load_source(run)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, trained.model(ids), rtol=0, atol=0)
    before = transformers.AutoModelForCausalLM.from_pretrained(src_dir)
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), exported.parameters()))  # it trained
    capsys.readouterr()
    assert cmd_export(["onnx", str(run), "--out", str(tmp_path / "onnx")]) == 2
    assert "`elbowroom export hf` writes it back in its own format" in capsys.readouterr().err
    assert not (tmp_path / "onnx").exists()
