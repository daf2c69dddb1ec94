"""The planner's profile: bytes by kind per block, the analytic source equal to a measured trace, the device
table and the machine measurement, and a model left exactly as it was."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from elbowroom.models import ModelConfig, build_model
from elbowroom.plan import DEVICES, get_device, measure_machine, profile, profile_from_dict

CPU = get_device("cpu")
B, S, D, H, FFN = 2, 16, 64, 4, 128
T = B * S  # tokens of the micro-batch


def _cfg(arch: str, **kw) -> ModelConfig:
    return ModelConfig(arch=arch, n_layers=2, dim=D, n_heads=H, ffn_dim=FFN, max_seq_len=32, **kw)


def _ids(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(1))


def _quick(model, batch, **kw):
    # one timed step per mode: these tests check bytes and plumbing, not CPU timings
    return profile(model, batch, machine=CPU, warmup=0, iters=1, **kw)


def _assert_same_bytes(measured, analytic, slack: int = 0) -> None:
    """Equal bytes; ``slack`` per kind and block allows for a CUDA kernel's few bytes of scalar side outputs
    (the attention kernel's random-number seed and offset) whose size the meta trace does not reproduce."""
    assert len(measured.blocks) == len(analytic.blocks)
    for bm, ba in zip(measured.blocks, analytic.blocks):
        assert bm.saved_bytes.keys() == ba.saved_bytes.keys()
        for kind in bm.saved_bytes:
            assert abs(bm.saved_bytes[kind] - ba.saved_bytes[kind]) <= slack, (bm.index, kind, bm.saved_bytes,
                                                                                ba.saved_bytes)
        assert abs(bm.selective_saved_bytes - ba.selective_saved_bytes) <= 4 * slack
        assert bm.input_bytes == ba.input_bytes
        assert bm.largest_saved_bytes == ba.largest_saved_bytes
        assert bm.flops == ba.flops
        assert bm.num_params == ba.num_params and bm.param_bytes == ba.param_bytes
    assert measured.head.saved_bytes == analytic.head.saved_bytes
    assert measured.head.flops == analytic.head.flops
    assert measured.head.logits_transient_bytes == analytic.head.logits_transient_bytes
    # model state saved (weights, their casts: shown, never planned on) may differ on CUDA by the casts' layout
    for key in ("shared_saved_bytes", "forward_flops") if slack else ("state_saved_bytes", "shared_saved_bytes",
                                                                      "forward_flops"):
        assert measured.extra[key] == analytic.extra[key], key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("arch,dropout", [("llama", 0.0), ("gpt2", 0.0), ("gpt2", 0.1)],
                         ids=["llama", "gpt2", "gpt2-dropout"])
def test_analytic_bytes_equal_measured_cpu_trace(arch: str, dropout: float, dtype: torch.dtype) -> None:
    cfg = _cfg(arch, dropout=dropout)
    torch.manual_seed(0)
    measured = _quick(build_model(cfg), _ids(), dtype=dtype)
    analytic = profile(build_model(cfg, device="meta"), _ids(), machine=CPU, dtype=dtype)
    assert (measured.source, analytic.source) == ("measured", "analytic")
    assert measured.compute_dtype == analytic.compute_dtype == str(dtype).split(".")[-1]
    _assert_same_bytes(measured, analytic)


def test_llama_block_kinds() -> None:
    torch.manual_seed(0)
    prof = _quick(build_model(_cfg("llama")), _ids(), dtype=torch.float32)
    blk = prof.blocks[0]
    x = T * D * 4
    assert blk.input_bytes == x and blk.saved_bytes["input"] == x
    # SwiGLU saves the fused gate/up projection's output (a matmul output) for its backward
    assert blk.saved_bytes["matmul"] >= T * 2 * FFN * 4
    # the attention kernel's output and its fp32 logsumexp
    assert blk.saved_bytes["attention"] == T * D * 4 + B * H * S * 4
    assert blk.saved_bytes["pointwise"] > 0  # norms, RoPE, SwiGLU's activation
    # selective keeps the input and the matmul / attention outputs (qkv, o, w13; the last, w2, is dropped)
    kept = T * 3 * D * 4 + T * D * 4 + T * 2 * FFN * 4 + (T * D * 4 + B * H * S * 4)
    assert blk.selective_saved_bytes == x + kept
    assert x < blk.selective_saved_bytes < blk.total_saved_bytes
    assert blk.largest_saved_bytes <= blk.total_saved_bytes
    assert prof.blocks[0].signature == prof.blocks[1].signature
    assert prof.block_path == "blocks"
    # parameters are model state: the fp32 weights matmuls save are not activations
    assert prof.extra["state_saved_bytes"][0] > 0
    assert prof.num_params == sum(p.numel() for p in build_model(_cfg("llama"), device="meta").parameters())


def test_bf16_autocast_halves_matmul_bytes() -> None:
    torch.manual_seed(0)
    model = build_model(_cfg("llama"))
    fp32 = _quick(model, _ids(), dtype=torch.float32)
    bf16 = _quick(model, _ids(), dtype=torch.bfloat16)
    assert bf16.blocks[0].saved_bytes["matmul"] * 2 == fp32.blocks[0].saved_bytes["matmul"]
    assert bf16.blocks[0].saved_bytes["input"] == fp32.blocks[0].saved_bytes["input"]  # the fp32 residual stream
    assert bf16.compute_dtype == "bfloat16" and bf16.param_dtype == "float32" and bf16.extra["autocast"]


def test_profiling_twice_gives_the_same_bytes() -> None:
    # the second time, RoPE's cast tables are already in its cache: still model state, not activations
    torch.manual_seed(0)
    model = build_model(_cfg("llama"))
    first = _quick(model, _ids(), dtype=torch.bfloat16)
    second = _quick(model, _ids(), dtype=torch.bfloat16)
    _assert_same_bytes(first, second)


def test_analytic_for_a_gpu_uses_its_attention_kernel() -> None:
    prof = profile(build_model(_cfg("gpt2", dropout=0.1), device="meta"), _ids(), machine="h100-80gb")
    blk = prof.blocks[0]
    # flash attention on the H100, dropout included: bf16 output + fp32 logsumexp (+ its philox seed/offset)
    assert blk.saved_bytes["attention"] >= T * D * 2 + B * H * S * 4
    assert blk.saved_bytes["attention"] < T * D * 2 + B * H * S * 4 + 64


def test_analytic_for_a_gpu_runs_fused_rms_norm_and_dropout() -> None:
    llama = build_model(_cfg("llama"), device="meta")
    on_cpu = profile(llama, _ids(), machine=CPU, dtype=torch.float32).blocks[0].saved_bytes
    on_gpu = profile(llama, _ids(), machine="h100-80gb", dtype=torch.float32).blocks[0].saved_bytes
    # CUDA's fused RMSNorm saves its input and rstd; the decomposition also saves the normalised input (x2 norms)
    assert on_cpu["pointwise"] - on_gpu["pointwise"] == 2 * T * D * 4
    gpt2 = build_model(_cfg("gpt2", dropout=0.1), device="meta")
    on_cpu = profile(gpt2, _ids(), machine=CPU, dtype=torch.float32).blocks[0].saved_bytes
    on_gpu = profile(gpt2, _ids(), machine="h100-80gb", dtype=torch.float32).blocks[0].saved_bytes
    # CUDA dropout saves a bool mask, the CPU one an fp32 noise tensor: residual and MLP dropout, T x D each;
    # attention dropout runs inside the CUDA kernel, on the CPU in the math path
    assert on_gpu["pointwise"] < on_cpu["pointwise"] - 2 * T * D * 3


def test_gpt2_dropout_masks_are_pointwise() -> None:
    torch.manual_seed(0)
    plain = _quick(build_model(_cfg("gpt2")), _ids(), dtype=torch.float32)
    drop = _quick(build_model(_cfg("gpt2", dropout=0.1)), _ids(), dtype=torch.float32)
    # dropout saves masks (pointwise); with dropout the CPU attention takes the math path (its matmuls)
    assert drop.blocks[0].saved_bytes["pointwise"] > plain.blocks[0].saved_bytes["pointwise"]
    assert drop.blocks[0].saved_bytes["attention"] == 0 < plain.blocks[0].saved_bytes["attention"]


def test_analytic_times_from_kernel_shapes_and_bytes() -> None:
    """A block's analytic forward is its four GEMMs and its causal attention, each timed from its shape
    (elbowroom.plan.kernels), plus its pointwise bytes at memory speed; the backward is longer."""
    from elbowroom.plan import kernels

    prof = profile(build_model(_cfg("llama"), device="meta"), _ids(), machine="h100-80gb")
    assert prof.compute_dtype == "bfloat16"  # the default for a GPU target
    m = prof.machine
    t, hd = B * S, D // H
    gemms = [(t, 3 * D, D), (t, D, D), (t, 2 * FFN, D), (t, D, FFN)]  # qkv, out, w13, w2: (m, n, k)
    expected = sum(kernels.seconds(("gemm", 1, a, b, c, 2), m) for a, b, c in gemms)
    expected += kernels.seconds(("attention", B, H, S, S, hd, True, False), m)
    for blk in prof.blocks:
        assert blk.flops > 0 and blk.forward_s > 0 and blk.backward_s > blk.forward_s
        assert blk.recompute_s == blk.forward_s
        mem = 2 * blk.saved_bytes["pointwise"] / m.memory_bandwidth
        assert blk.selective_recompute_s == pytest.approx(mem)
        assert blk.forward_s == pytest.approx(expected + mem, rel=1e-9)
    assert prof.head.flops > 0 and prof.head.forward_s > 0


def test_kernel_times_by_shape() -> None:
    """The kernel model's arithmetic: a GEMM's FLOPs plus its bytes; causal attention walks the tiles on and below
    the diagonal, each at a cost that shrinks less than its head dim; the backward is BACKWARD_RATIO forwards;
    an op it does not know is its FLOPs at the matmul rate."""
    from elbowroom.plan import get_device, kernels

    m = get_device("h200")
    gemm = kernels.seconds(("gemm", 2, 4096, 1600, 1600, 2), m)
    assert gemm == pytest.approx(2 * 2 * 4096 * 1600 * 1600 / m.matmul_flops
                                 + 2 * 2 * (4096 * 1600 + 1600 * 1600 + 4096 * 1600) / m.memory_bandwidth)
    assert kernels.seconds(("flops", 1e12), m) == pytest.approx(1e12 / m.matmul_flops)
    full = kernels.seconds(("attention", 1, 8, 1024, 1024, 128, False, False), m)
    causal = kernels.seconds(("attention", 1, 8, 1024, 1024, 128, True, False), m)
    assert causal / full == pytest.approx(36 / 64)  # 8 tiles a side: 1 + 2 + ... + 8 of 64
    assert kernels.seconds(("attention", 1, 8, 1024, 1024, 128, True, True), m) == pytest.approx(
        kernels.BACKWARD_RATIO * causal)
    half = kernels.seconds(("attention", 1, 8, 1024, 1024, 64, True, False), m)
    assert causal / 2 < half < causal  # half the matmul work, the same softmax
    # what the tracer records of real ops (meta tensors: shapes only)
    a, w = torch.empty(3, 5, 7, device="meta"), torch.empty(11, 7, device="meta")
    assert kernels.describe(torch.ops.aten.mm.default, (a.view(15, 7), w.t()), {}, 0.0) == ("gemm", 1, 15, 11, 7, 4)
    assert kernels.describe(torch.ops.aten.bmm.default, (a, torch.empty(3, 7, 2, device="meta")), {}, 0.0) == (
        "gemm", 3, 5, 2, 7, 4)
    q = torch.empty(2, 4, 256, 64, device="meta", dtype=torch.bfloat16)
    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert kernels.describe(op, (q, q, q, None, True, 0.0, True), {}, 0.0) == (
        "attention", 2, 4, 256, 256, 64, True, False)
    assert kernels.describe(torch.ops.aten.convolution.default, (), {}, 5.0) == ("flops", 5.0)


def test_measured_times_are_positive() -> None:
    torch.manual_seed(0)
    prof = profile(build_model(_cfg("llama")), _ids(), machine=CPU, warmup=1, iters=2)
    for blk in prof.blocks:
        assert blk.forward_s > 0 and blk.backward_s > 0
        assert blk.recompute_s >= 0 and blk.selective_recompute_s >= 0
    assert prof.head.forward_s >= 0 and prof.allocator_overhead_bytes == 0


def test_recompute_costs_count_the_checkpointed_forward(monkeypatch) -> None:
    # A recompute costs its backward's extra and its forward's: selective recompute runs every op of the forward
    # through a dispatch mode on the host (on GPT-2-XL's small blocks the selective forward took twice the plain
    # one). Fabricated per-block timings make the arithmetic exact.
    from elbowroom.plan import profiler

    times = {None: (1.0, 2.0), "full": (1.1, 3.0), "selective": (2.0, 2.5)}  # (forward, backward) per block

    def fake_time_modes(self, warmup, iters, modes=(None, "full", "selective")):
        n = len(self.blocks)
        return {m: {"fwd": [times[m][0]] * n, "bwd": [times[m][1]] * n, "total_fwd": 5.0 * n,
                    "total_bwd": 5.0 * n} for m in modes}

    monkeypatch.setattr(profiler._Runner, "time_modes", fake_time_modes)
    prof = profile(build_model(_cfg("gpt2", dropout=0.1)), _ids(), machine=CPU)
    for blk in prof.blocks:
        assert blk.forward_s == 1.0 and blk.backward_s == 2.0
        assert blk.recompute_s == pytest.approx(0.1 + 1.0)
        assert blk.selective_recompute_s == pytest.approx(1.0 + 0.5)  # more than full: what the host pays


def test_head_profile() -> None:
    torch.manual_seed(0)
    cfg = _cfg("llama")
    prof = _quick(build_model(cfg), _ids(), dtype=torch.bfloat16)
    v = cfg.vocab_size
    n = B * (S - 1)  # next-token loss: the last position predicts nothing
    assert prof.extra["vocab_size"] == v
    assert prof.head.logits_transient_bytes == T * v * (2 + 4 + 4)
    assert prof.head.fused_transient_bytes == T * v * 4  # fewer tokens than one chunk (4096)
    assert prof.head.saved_bytes >= n * v * 4  # log-softmax of the fp32 logits
    head_params = cfg.vocab_size * D * 2 + D  # embedding, output head, final norm
    assert prof.head.num_params == head_params
    # the output head and the final norm come after the blocks (final first in the backward, needed last)
    assert prof.head.after_params == cfg.vocab_size * D + D


def test_pair_batch_and_loss_fn() -> None:
    torch.manual_seed(0)
    model = build_model(_cfg("gpt2"))
    ids = _ids()
    pair = _quick(model, (ids, ids.roll(-1, 1)), dtype=torch.float32)

    def loss_fn(m, batch):
        logits = m(batch[0])
        return F.cross_entropy(logits.float().flatten(0, 1), batch[1].flatten())

    custom = _quick(model, (ids, ids.roll(-1, 1)), dtype=torch.float32, loss_fn=loss_fn)
    assert [b.saved_bytes for b in pair.blocks] == [b.saved_bytes for b in custom.blocks]


class _OwnLoss(torch.nn.Module):
    """A model that returns its own scalar loss (what the profile cannot read as logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_model(_cfg("llama"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.inner(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def test_a_model_returning_its_loss_or_a_triple_batch_is_told_to_pass_loss_fn() -> None:
    torch.manual_seed(0)
    model, ids = _OwnLoss(), _ids()
    with pytest.raises(TypeError, match=r"tensor of shape \(\), not logits.*loss_fn=lambda model, batch: model"):
        _quick(model, ids, dtype=torch.float32, blocks="inner.blocks")
    with pytest.raises(TypeError, match=r"\(inputs, targets\), not 3 items; pass loss_fn="):
        _quick(model.inner, (ids, ids, ids), dtype=torch.float32)
    with pytest.raises(TypeError, match=r"loss_fn\(model, batch\) must return the scalar loss, not a tensor of "
                                        r"shape \(\d+, \d+\): reduce it"):
        _quick(model, ids, dtype=torch.float32, blocks="inner.blocks",
               loss_fn=lambda m, batch: F.cross_entropy(m.inner(batch).transpose(1, 2).float(), batch,
                                                        reduction="none"))
    # the fix the messages name works
    own = _quick(model, ids, dtype=torch.float32, blocks="inner.blocks", loss_fn=lambda m, batch: m(batch))
    assert len(own.blocks) == 2 and all(sum(b.saved_bytes.values()) > 0 for b in own.blocks)


def test_explicit_blocks() -> None:
    model = build_model(_cfg("llama"), device="meta")
    by_path = profile(model, _ids(), machine=CPU, blocks="blocks")
    by_list = profile(model, _ids(), machine=CPU, blocks=list(model.blocks))
    assert by_path.block_path == by_list.block_path == "blocks"
    assert [b.saved_bytes for b in by_path.blocks] == [b.saved_bytes for b in by_list.blocks]
    with pytest.raises(ValueError, match="not a submodule path"):
        profile(model, _ids(), machine=CPU, blocks="nope")


def test_json_round_trip() -> None:
    prof = _quick(build_model(_cfg("gpt2")), _ids())
    again = profile_from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again == prof


def _snapshot(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_model_unchanged_after_profiling() -> None:
    cfg = _cfg("gpt2", dropout=0.1)
    torch.manual_seed(0)
    model = build_model(cfg)
    model.blocks[1].eval()  # a mixed training state must come back as it was
    before = _snapshot(model)
    flags = [m.training for m in model.modules()]
    rng = torch.get_rng_state()

    _quick(model, _ids(), dtype=torch.bfloat16)

    assert torch.equal(rng, torch.get_rng_state())
    assert [m.training for m in model.modules()] == flags
    after = _snapshot(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
        assert "forward" not in m.__dict__  # no recompute wrapper left
    assert all(p.grad is None for p in model.parameters())


def test_profiling_does_not_change_later_dropout_masks() -> None:
    cfg = _cfg("gpt2", dropout=0.1)

    def loss_after(profiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = build_model(cfg)
        if profiled:
            _quick(model, _ids())
        model.train()
        ids = _ids()
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    assert torch.equal(loss_after(False), loss_after(True))


def test_wrapped_blocks_are_refused() -> None:
    import elbowroom

    model = build_model(_cfg("llama"))
    elbowroom.checkpoint(model.blocks[0], "full")
    with pytest.raises(ValueError, match="before applying"):
        _quick(model, _ids())


def test_analytic_profile_of_a_real_model_traces_a_meta_copy() -> None:
    model = build_model(_cfg("llama"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    on_meta = profile(build_model(_cfg("llama"), device="meta"), _ids(), source="analytic", machine=CPU)
    on_cpu = profile(model, _ids(), source="analytic", machine=CPU)
    assert on_cpu.blocks == on_meta.blocks and on_cpu.head == on_meta.head
    for n, p in model.named_parameters():  # the model itself is untouched and stays where it was
        assert p.device.type == "cpu" and torch.equal(p, before[n]) and p.grad is None


def test_source_errors() -> None:
    with pytest.raises(ValueError, match="source must be"):
        profile(build_model(_cfg("llama"), device="meta"), _ids(), source="guess")
    with pytest.raises(ValueError, match="source='analytic'"):
        profile(build_model(_cfg("llama"), device="meta"), _ids(), source="measured")
    with pytest.raises(ValueError, match="needs blocks= as a dotted path"):
        m = build_model(_cfg("llama"))
        profile(m, _ids(), source="analytic", machine=CPU, blocks=list(m.blocks))
    with pytest.raises(TypeError, match="sample_batch"):
        profile(build_model(_cfg("llama"), device="meta"), torch.zeros(4, dtype=torch.long), machine=CPU)


# ---- Hugging Face models (transformers is a test dependency) ---------------------------------------------


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=D, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=H,
        num_key_value_heads=H // 2, max_position_embeddings=64, attn_implementation="sdpa",  # grouped k/v
    )
    return lambda: transformers.LlamaForCausalLM(cfg)


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=D, n_layer=2, n_head=H, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return lambda: transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_hf_llama_analytic_equals_measured(dtype: torch.dtype) -> None:
    make = _hf_llama()
    ids = _ids(128)
    torch.manual_seed(0)
    measured = _quick(make(), ids, dtype=dtype)
    with torch.device("meta"):
        meta_model = make()
    analytic = profile(meta_model, ids, machine=CPU, dtype=dtype)
    assert measured.block_path == analytic.block_path == "model.layers"
    _assert_same_bytes(measured, analytic)
    blk = measured.blocks[0]
    assert blk.saved_bytes["attention"] > 0 and blk.saved_bytes["matmul"] > 0
    assert blk.selective_saved_bytes < blk.total_saved_bytes
    # the rotary cos/sin are made once and passed to every layer: shared, not counted per block
    assert measured.extra["shared_saved_bytes"][0] > 0


def test_hf_llama_dict_batch_with_labels() -> None:
    make = _hf_llama()
    ids = _ids(128)
    torch.manual_seed(0)
    prof = _quick(make(), {"input_ids": ids, "labels": ids}, dtype=torch.float32)
    assert prof.extra["vocab_size"] == 128 and prof.micro_batch == B and prof.seq_len == S
    with pytest.raises(ValueError, match="labels"):
        _quick(make(), {"input_ids": ids})


def test_hf_gpt2_found_and_profiled() -> None:
    make = _hf_gpt2()
    ids = _ids(128)
    torch.manual_seed(0)
    measured = _quick(make(), ids, dtype=torch.float32)
    with torch.device("meta"):
        meta_model = make()
    analytic = profile(meta_model, ids, machine=CPU, dtype=torch.float32)
    assert measured.block_path == "transformer.h" and len(measured.blocks) == 2
    _assert_same_bytes(measured, analytic)
    # the head is tied to the token embedding, which is needed first: only the final norm comes after the blocks
    d = make().config.n_embd
    assert measured.head.after_params == analytic.head.after_params == 2 * d  # ln_f's weight and bias


# ---- machines ----------------------------------------------------------------------------------------------


def test_device_table() -> None:
    h100 = get_device("h100-80gb")
    assert h100.matmul_flops == 779e12 and h100.duplex_bandwidth == 45e9 and h100.h2d_bandwidth == 55e9
    assert h100.source == "table" and h100.host_memory_bytes > 0
    assert get_device("H100") == h100
    assert get_device("h200").device_memory_bytes > h100.device_memory_bytes
    for name in ("a100-40gb", "a100-80gb", "l4-24gb", "rtx4090-24gb"):
        prof = get_device(name)
        assert 0 < prof.matmul_flops < h100.matmul_flops and prof.h2d_bandwidth > 0
    cpu = get_device("cpu")
    assert cpu.h2d_bandwidth == cpu.d2h_bandwidth == cpu.duplex_bandwidth == 0
    assert get_device("h100", host_memory=123).host_memory_bytes == 123


def test_unknown_device_lists_known_ones() -> None:
    with pytest.raises(ValueError) as e:
        get_device("tpu-v9")
    for name in DEVICES:
        assert name in str(e.value)


def test_measure_machine_cpu_cached(tmp_path) -> None:
    small = {"matmul_size": 128, "copy_bytes": 1 << 20, "adam_numel": 10_000, "repeats": 1}
    torch.manual_seed(7)
    prof = measure_machine("cpu", cache_dir=tmp_path, **small)
    drawn = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(4))  # measured, it drew nothing from the global RNG (a run's dropout)
    assert prof.source == "measured" and prof.name == "cpu" and prof.matmul_flops > 0
    assert prof.h2d_bandwidth == 0 and prof.host_adam_params_per_s > 0
    (path,) = tmp_path.glob("machine-*.json")
    assert json.loads(path.read_text())["matmul_flops"] == prof.matmul_flops
    assert measure_machine("cpu", cache_dir=tmp_path, **small) == prof  # read back, not measured again


def test_measure_machine_errors() -> None:
    with pytest.raises(ValueError, match="cuda or cpu"):
        measure_machine("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            measure_machine("cuda")


# ---- on a GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_measured_profile_on_cuda(tmp_path) -> None:
    machine = measure_machine("cuda", cache_dir=tmp_path, matmul_size=4096, adam_numel=5_000_000)
    assert machine.matmul_flops > 1e12 and machine.h2d_bandwidth > 1e9 and machine.duplex_bandwidth > 1e9
    cfg = ModelConfig(n_layers=2, dim=256, n_heads=4, ffn_dim=768, max_seq_len=256)
    torch.manual_seed(0)
    model = build_model(cfg, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    from elbowroom.plan.devices import expandable_segments_on

    before = expandable_segments_on()
    prof = profile(model, ids, machine=machine)
    assert prof.compute_dtype == "bfloat16" and prof.source == "measured"
    for blk in prof.blocks:
        assert blk.forward_s > 0 and blk.backward_s > 0 and blk.saved_bytes["attention"] > 0
        assert blk.selective_saved_bytes < blk.total_saved_bytes
    margins = prof.allocator_overhead_bytes, prof.allocator_overhead_expandable_bytes
    if before is None:
        # this torch cannot tell the allocator's setting: it is not switched, nothing is measured, and a plan
        # prices it with ALLOCATOR_MARGIN instead
        assert margins == (0, 0)
    else:  # each setting measured over steps of its own (at least 1), and the process's setting given back
        assert min(margins) > 0 and expandable_segments_on() == before
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.gpu
def test_compiled_profile_on_cuda(tmp_path) -> None:
    # the profile of compiled blocks under bf16 autocast on CUDA (the Triton kernels give way to the compiler's):
    # positive times, selective less than kept, the model as found, and the bytes it counts are what the caching
    # allocator holds after a forward of the blocks compiled. (Not "no more than eager": at this size the
    # partitioner saves 6.4 MB a block where eager, with the fused RMSNorm and SwiGLU, saves 5.0;
    # benchmarks/compiled_saved.py prints both.)
    from elbowroom import compile_blocks

    machine = measure_machine("cuda", cache_dir=tmp_path, matmul_size=4096, adam_numel=5_000_000)
    cfg = ModelConfig(n_layers=2, dim=256, n_heads=4, ffn_dim=768, max_seq_len=256)
    torch.manual_seed(0)
    model = build_model(cfg, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    compiled = profile(model, ids, machine=machine, compiled=True)
    assert compiled.extra["compiled_blocks"] is True
    for c in compiled.blocks:
        assert c.forward_s > 0 and c.backward_s > 0
        assert c.input_bytes < c.selective_saved_bytes < c.total_saved_bytes
    for blk in model.blocks:
        assert "forward" not in blk.__dict__ and not any(k.startswith("_elbowroom") for k in blk.__dict__)
    assert all(p.grad is None for p in model.parameters())
    compile_blocks(model)
    _alive_after_forward(model, ids)  # the first compiles
    alive, predicted = _alive_after_forward(model, ids), _predicted_alive(compiled)
    # never fewer bytes than the allocator holds (a plan priced on them would overrun its budget). The H200 held
    # 14.3 MB of 17.7 predicted (twenty-first session). Not the weights' bf16 casts, as first thought: the compiled
    # nodes hold them on CUDA too (benchmarks/compiled_saved.py, twenty-second session); where the 3.4 MB go is open
    assert 0.75 * predicted <= alive <= predicted * 1.1 + (4 << 20)


@pytest.mark.gpu
def test_analytic_equals_measured_on_cuda_hf_llama() -> None:
    # a model with no elbowroom kernels in it: the meta trace for an H100 must save what CUDA saves
    make = _hf_llama()
    ids = torch.randint(0, 128, (2, 256))
    h100 = get_device("h100-80gb")
    torch.manual_seed(0)
    measured = profile(make().cuda(), ids.cuda(), machine=h100)
    with torch.device("meta"):
        meta_model = make()
    analytic = profile(meta_model, ids, machine=h100)
    assert measured.compute_dtype == analytic.compute_dtype == "bfloat16"
    _assert_same_bytes(measured, analytic, slack=64)


@pytest.mark.gpu
def test_analytic_equals_measured_on_cuda_reference_llama_eager_swiglu() -> None:
    # elbowroom's fused SwiGLU saves less than its eager form, which the meta trace runs: switched off here
    cfg = ModelConfig(n_layers=2, dim=256, n_heads=4, ffn_dim=768, max_seq_len=256)
    ids = torch.randint(0, cfg.vocab_size, (2, 256))
    h100 = get_device("h100-80gb")
    torch.manual_seed(0)
    model = build_model(cfg, device="cuda")
    for blk in model.blocks:
        blk.fused_swiglu = False
    measured = profile(model, ids.cuda(), machine=h100)
    meta_model = build_model(cfg, device="meta")
    for blk in meta_model.blocks:
        blk.fused_swiglu = False
    analytic = profile(meta_model, ids, machine=h100)
    _assert_same_bytes(measured, analytic, slack=64)


def _alive_after_forward(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """The bytes the caching allocator holds after a forward under bf16 autocast and its loss (the step's backward
    then runs, so that nothing stays)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    del logits
    alive = torch.cuda.memory_allocated() - base
    loss.backward()
    model.zero_grad(set_to_none=True)
    return alive


def _predicted_alive(prof: Any) -> int:
    """What a profile says a forward leaves alive: the blocks' and the head's saved bytes, and their state's."""
    return (sum(b.total_saved_bytes for b in prof.blocks) + prof.head.saved_bytes
            + sum(prof.extra["state_saved_bytes"]) + prof.extra["head_state_saved_bytes"])


@pytest.mark.gpu
def test_saved_bytes_match_the_allocator_on_cuda() -> None:
    # what the profile says a plain forward keeps alive, against what the caching allocator holds after it
    cfg = ModelConfig(n_layers=2, dim=256, n_heads=4, ffn_dim=768, max_seq_len=256)
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    torch.manual_seed(0)
    model = build_model(cfg, device="cuda")
    prof = profile(model, ids, machine=get_device("h100-80gb"))
    alive, predicted = _alive_after_forward(model, ids), _predicted_alive(prof)
    # the allocator rounds every block up to 512 bytes; the head's state includes the ids (not allocated here)
    assert 0.95 * predicted <= alive <= predicted * 1.1 + (4 << 20)


def test_measured_profile_leaves_no_activations_alive() -> None:
    # a checkpoint's cache left unread by a forward-only step outlived it in a cycle through autograd (W1 on the
    # H100 kept ~15 GiB after profiling): count the tensor bytes alive before and after
    import gc

    def live_bytes() -> int:
        gc.collect()
        return sum(o.untyped_storage().nbytes() for o in gc.get_objects()
                   if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter) and o.device.type == "cpu")

    model = build_model(_cfg("llama"))
    ids = _ids()
    before = live_bytes()
    profile(model, ids, source="measured", machine=CPU, warmup=0, iters=1)
    assert live_bytes() - before <= 0


def test_a_model_whose_plain_step_does_not_fit_is_profiled_recomputed(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # the unplanned step runs out of memory: bytes come from a meta trace, times from steps with every block
    # recomputed (what a 7B model on an 80 GB device needs)
    from elbowroom.plan import profiler

    cfg = _cfg("llama")
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = _ids(cfg.vocab_size)
    trace, time_modes = profiler._Runner.trace, profiler._Runner.time_modes
    timed: list[tuple] = []

    def oom_trace(self, mode):
        if self.device.type != "meta" and mode is None:
            raise torch.OutOfMemoryError("simulated: the plain step does not fit")
        return trace(self, mode)

    def record_modes(self, warmup, iters, modes=(None, "full", "selective")):
        timed.append(modes)
        return time_modes(self, warmup, iters, modes)

    monkeypatch.setattr(profiler._Runner, "trace", oom_trace)
    monkeypatch.setattr(profiler._Runner, "time_modes", record_modes)
    with caplog.at_level("WARNING"):
        got = _quick(model, ids)
    assert "does not fit" in caplog.text and timed == [("full",)]
    assert got.source == "measured" and got.allocator_overhead_bytes == 0
    monkeypatch.undo()
    _assert_same_bytes(got, profile(build_model(cfg, device="meta"), ids.to("meta"), machine=CPU))
    for b in got.blocks:
        assert b.forward_s > 0 and b.backward_s >= 0 and b.recompute_s == pytest.approx(b.forward_s)
        assert b.selective_recompute_s > 0  # priced from its pointwise bytes
    assert got.head.forward_s >= 0 and got.head.backward_s >= 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("option", [(None, 0.25), (None, 0.5), ("selective", 0.25), ("selective", 0.5)],
                         ids=["keep-0.25", "keep-0.5", "selective-0.25", "selective-0.5"])
def test_priced_offload_bytes_are_what_the_engine_moves(option) -> None:
    # The engine offloads whole tensors, largest first, until the ratio of the eligible bytes is reached: the cost
    # model must price those bytes, not the ratio's share (on GPT-2-XL 0.25 moved 42% of a block's bytes). A
    # model whose activations pass the engine's 1 MiB floor (1024 tokens x 256 x 4 B), on the simulated host.
    from elbowroom.activations import BlockPolicy, apply_block_policies, get_offload_engine
    from elbowroom.activations.offload import DEFAULT_MIN_OFFLOAD_BYTES
    from elbowroom.plan import options
    from elbowroom.plan.cost import OPTIONS, Option

    assert options.DEFAULT_MIN_OFFLOAD_BYTES == DEFAULT_MIN_OFFLOAD_BYTES
    from elbowroom.activations._wrap import PREFETCH_LEAD_BLOCKS

    assert options.PREFETCH_LEAD_BLOCKS == PREFETCH_LEAD_BLOCKS  # the lead the planner prices is the engine's
    checkpoint, ratio = option
    torch.manual_seed(0)
    cfg = ModelConfig(arch="gpt2", n_layers=2, dim=256, n_heads=4, ffn_dim=1024, max_seq_len=512, dropout=0.1)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 512), generator=torch.Generator().manual_seed(1))
    prof = _quick(model, ids)
    o = Option(checkpoint or "none", ratio)
    _, off, _ = options.option_bytes(prof.blocks[0])
    priced = off[OPTIONS.index(o)]
    share = ratio * (prof.blocks[0].total_saved_bytes if checkpoint is None
                     else prof.blocks[0].selective_saved_bytes - prof.blocks[0].input_bytes)
    apply_block_policies(model, [BlockPolicy(checkpoint=o.checkpoint, offload_ratio=ratio)] * 2, simulate_host=True)
    engine = get_offload_engine(model)

    def step() -> int:
        before = engine.stats().offloaded_bytes
        logits = model(ids)[:, :-1]
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        return engine.stats().offloaded_bytes - before

    step()  # the first pass of a ratio offloads everything and measures the sizes
    moved = step() / 2  # two blocks alike
    assert moved == priced, (moved, priced, share)
    assert priced > 0


def test_the_snapshot_tells_an_expandable_segment() -> None:
    # torch 2.11 has no getter for the allocator's settings: a fresh block's segment in the snapshot tells
    from elbowroom.plan.devices import segment_is_expandable

    segments = [{"address": 1000, "total_size": 100, "is_expandable": False},
                {"address": 5000, "total_size": 1 << 20, "is_expandable": True},
                {"address": 9 << 20, "total_size": 100}]  # an older torch's snapshot: no flag
    assert segment_is_expandable(segments, 5000 + 4096) is True
    assert segment_is_expandable(segments, 1099) is False
    assert segment_is_expandable(segments, 1100) is None  # past the first segment's end: no segment holds it
    assert segment_is_expandable(segments, (9 << 20) + 1) is None
    assert segment_is_expandable([], 0) is None


# ---------------------------------------------------------------- compiled blocks
def _saved_per_block(model: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    """What each block saves for backward in one step, counted by saved-tensor hooks alone (each storage once per
    block, parameters and buffers left out): a count independent of the profiler's."""
    from elbowroom.activations.recompute import find_blocks

    blocks = list(find_blocks(model))
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    current: list[int | None] = [None]
    seen: list[set[int]] = [set() for _ in blocks]
    counts = [0] * len(blocks)

    def pack(t: torch.Tensor) -> torch.Tensor:
        i, ptr = current[0], t.untyped_storage().data_ptr()
        if i is not None and ptr not in state and ptr not in seen[i]:
            seen[i].add(ptr)
            counts[i] += t.untyped_storage().nbytes()
        return t

    handles = [b.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)) for b in blocks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)).backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return counts


@pytest.mark.parametrize("mode", [None, "selective"], ids=["kept", "selective"])
def test_compiled_profile_counts_what_the_compiled_blocks_save(mode: str | None) -> None:
    # compiled=True: the bytes each block saves kept whole and under selective recompute are those of the blocks
    # compiled, as an independent count of the same compiled blocks finds them; kept whole, the compiler's
    # partition saves less than eager blocks do. The model is left as it was: no compiled forward, no wrapper.
    import copy

    from elbowroom.activations import BlockPolicy, apply_block_policies, compile_blocks

    torch.manual_seed(0)
    model = build_model(_cfg("llama"))
    ids = _ids()
    eager = _quick(model, ids)
    compiled = _quick(model, ids, compiled=True)
    assert compiled.extra["compiled_blocks"] is True and eager.extra["compiled_blocks"] is False
    for blk in model.blocks:
        assert "forward" not in blk.__dict__ and not any(k.startswith("_elbowroom") for k in blk.__dict__)

    ref = copy.deepcopy(model)
    if mode is not None:
        apply_block_policies(ref, [BlockPolicy(mode)] * len(ref.blocks))
    compile_blocks(ref)
    _saved_per_block(ref, ids)  # compiles
    counts = _saved_per_block(ref, ids)
    got = [b.total_saved_bytes if mode is None else b.selective_saved_bytes for b in compiled.blocks]
    assert got == counts
    if mode is None:
        assert all(c.total_saved_bytes < e.total_saved_bytes for c, e in zip(compiled.blocks, eager.blocks))
        assert [b.saved_bytes["input"] for b in compiled.blocks] == [b.input_bytes for b in eager.blocks]
    with pytest.raises(ValueError, match="compiled=True needs a measured profile"):
        profile(model, ids, source="analytic", machine=CPU, compiled=True)
    with pytest.raises(ValueError, match="compiled=True needs a measured profile"):
        profile(model, ids, source="analytic", machine=CPU, compiled={"recompute_pointwise": False})
    if mode is None:  # blocks the caller compiled: refused, not silently uncompiled
        with pytest.raises(ValueError, match="profile the model before compiling its blocks"):
            _quick(ref, ids)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "hf-llama"])
def test_analytic_compiled_with_pointwise_recompute_equals_measured(arch: str) -> None:
    # blocks compiled as planned runs compile them (recompute_pointwise=True) are priced analytically: a block kept
    # whole at what selective recompute keeps, which is what the compiled blocks measured on CPU save; the
    # selective bytes and the FLOPs are the eager trace's, and the plan notes say how it was priced
    import copy

    from elbowroom.plan import plan_for

    torch.manual_seed(0)
    if arch == "hf-llama":
        transformers = pytest.importorskip("transformers")
        cfg = transformers.LlamaConfig(hidden_size=D, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=H,
                                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=S,
                                       attn_implementation="sdpa", use_cache=False)
        model = transformers.LlamaForCausalLM(cfg)
        batch: Any = {"input_ids": _ids(), "labels": _ids()}
    else:
        model = build_model(_cfg(arch))
        batch = _ids()
    opts = {"recompute_pointwise": True}
    measured = _quick(copy.deepcopy(model), batch, dtype=torch.bfloat16, compiled=opts)
    eager = profile(model, batch, source="analytic", machine=CPU, dtype=torch.bfloat16)
    analytic = profile(model, batch, source="analytic", machine=CPU, dtype=torch.bfloat16, compiled=opts)
    assert analytic.extra["compiled_blocks"] is True and analytic.extra["compile_options"] == opts
    for m, a, e in zip(measured.blocks, analytic.blocks, eager.blocks):
        assert a.total_saved_bytes == e.selective_saved_bytes < e.total_saved_bytes
        # the compiled graph may also save the attention's fp32 log-sum-exp, which the eager selective cache
        # leaves to the recompute: B x heads x S x 4 bytes, a few kB here, under 0.2% of a W1 block
        assert 0 <= m.total_saved_bytes - a.total_saved_bytes <= B * H * S * 4
        assert a.selective_saved_bytes == e.selective_saved_bytes and a.flops == e.flops
        assert sum(a.saved_sizes) == a.total_saved_bytes and a.largest_saved_bytes == max(a.saved_sizes)
    notes = plan_for(analytic, 1 << 40).notes
    assert "the blocks compiled with compile_blocks(recompute_pointwise=True)" in notes
    assert any("selective" in n and "analytic" in n for n in notes)


def test_an_allocator_margin_whose_steps_run_out_of_memory_is_unknown(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The margin's steps run out of memory with one setting (the defaults fragment far more on the 7B shape: 16.9
    GiB against 1.75): that margin is unknown (0, priced as a share of the budget), the profile goes on, says so,
    and the other setting's steps still count."""
    import contextlib
    from types import SimpleNamespace

    from elbowroom.plan import profiler

    monkeypatch.setattr(profiler, "expandable_segments", lambda on: contextlib.nullcontext(True))

    def held(mode: str | None) -> int:
        if mode == "selective":
            raise torch.OutOfMemoryError("simulated")
        return 5 << 20

    runner = SimpleNamespace(_held_over_steps=held)
    with caplog.at_level("WARNING"):
        assert profiler._Runner._overhead(runner, False) == 0
    assert "ran out of memory with expandable_segments:False" in caplog.text
    runner = SimpleNamespace(_held_over_steps=lambda mode: (3 << 20) if mode else (5 << 20))
    assert profiler._Runner._overhead(runner, True) == 5 << 20  # the most of the two kinds of steps


@pytest.mark.parametrize("was", [False, True])
def test_a_margin_is_measured_with_its_own_setting_and_the_process_s_is_given_back(
        monkeypatch: pytest.MonkeyPatch, was: bool) -> None:
    """devices.expandable_segments (CUDA simulated): each setting is switched to for its measure from an empty cache,
    and the process's own is set again after it, also when the measure fails; a setting the process already runs is
    not switched; a torch that cannot tell the setting, or cannot switch it, measures nothing."""
    from elbowroom.plan import devices

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(devices, "expandable_segments_on", lambda: was)
    monkeypatch.setattr(devices, "allocator_settings_setter", lambda: calls.append)
    for on in (False, True):
        calls.clear()
        with devices.expandable_segments(on) as measured:
            assert measured is True
            calls.append("measure")
        switched = [f"expandable_segments:{on}", "measure", f"expandable_segments:{was}"]
        assert [c for c in calls if c != "empty"] == (switched if on != was else ["measure"])
        assert calls[0] == "empty" and calls[-1] == "empty"  # from an empty cache, and none of it left after
    calls.clear()
    with pytest.raises(RuntimeError), devices.expandable_segments(not was):
        raise RuntimeError("the measure failed")
    assert f"expandable_segments:{was}" in calls  # given back all the same
    monkeypatch.setattr(devices, "allocator_settings_setter", lambda: None)  # cannot switch
    with devices.expandable_segments(not was) as measured:
        assert measured is False
    with devices.expandable_segments(was) as measured:  # (nothing to switch)
        assert measured is True
    monkeypatch.setattr(devices, "expandable_segments_on", lambda: None)  # cannot tell
    with devices.expandable_segments(was) as measured:
        assert measured is False
