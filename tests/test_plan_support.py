"""Hand-made profiles for the planner's tests: transformer-shaped numbers, no profiler and no device needed."""

from __future__ import annotations

from elbowroom.plan.types import BlockProfile, HeadProfile, MachineProfile, Profile

GiB = 1 << 30

H100 = MachineProfile(
    name="h100-test",
    device_memory_bytes=80 * GiB,
    matmul_flops=6.0e14,
    memory_bandwidth=3.35e12,
    h2d_bandwidth=55e9,
    d2h_bandwidth=55e9,
    duplex_bandwidth=45e9,
    host_adam_params_per_s=4e9,
    host_memory_bytes=128 * GiB,
)


def make_profile(
    *,
    dim: int = 2048,
    n_layers: int = 24,
    ffn: int = 5632,
    vocab: int = 32000,
    micro_batch: int = 4,
    seq_len: int = 4096,
    machine: MachineProfile = H100,
    vary: bool = False,
    compute_dtype: str = "bfloat16",
) -> Profile:
    """A Llama-shaped profile (W1 by default) with bytes of bf16 autocast and times from FLOPs at the machine's rate.

    ``vary`` gives every other block a different width of its MLP (blocks of two signatures)."""
    tokens = micro_batch * seq_len
    blocks = []
    for i in range(n_layers):
        f = ffn if not (vary and i % 2) else ffn // 2
        params = 4 * dim * dim + 3 * dim * f
        inp = 4 * dim * tokens  # fp32 residual stream
        matmul = 2 * (3 * dim + dim + 2 * f + f) * tokens
        attention = 2 * dim * tokens + 4 * tokens
        pointwise = 2 * (2 * dim + f) * tokens
        flops = 6 * params * tokens + 6 * seq_len * dim * tokens
        fwd = flops / 3 / machine.matmul_flops
        blocks.append(
            BlockProfile(
                index=i,
                signature=f"LlamaBlock(d={dim},f={f})",
                num_params=params,
                param_bytes=4 * params,
                saved_bytes={"input": inp, "matmul": matmul, "attention": attention, "pointwise": pointwise},
                selective_saved_bytes=inp + matmul + attention,
                input_bytes=inp,
                largest_saved_bytes=2 * 2 * f * tokens,
                forward_s=fwd,
                backward_s=2 * fwd,
                recompute_s=fwd,
                selective_recompute_s=0.08 * fwd,
                flops=flops,
            )
        )
    head_params = 2 * vocab * dim + dim
    head_flops = 6 * vocab * dim * tokens
    head = HeadProfile(
        num_params=head_params,
        param_bytes=4 * head_params,
        saved_bytes=4 * vocab * tokens + 4 * dim * tokens,
        logits_transient_bytes=8 * vocab * tokens,
        fused_transient_bytes=6 * vocab * 4096,
        forward_s=head_flops / 3 / machine.matmul_flops,
        backward_s=2 * head_flops / 3 / machine.matmul_flops,
        flops=head_flops,
    )
    return Profile(
        source="analytic",
        machine=machine,
        micro_batch=micro_batch,
        seq_len=seq_len,
        compute_dtype=compute_dtype,
        param_dtype="float32",
        blocks=tuple(blocks),
        head=head,
        block_path="blocks",
    )
