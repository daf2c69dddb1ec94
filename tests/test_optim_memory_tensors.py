"""CPUOffloadOptimizer.memory_tensors(): what the memory report files under optimizer state and master weights."""

from __future__ import annotations

import torch

from elbowroom.optim import CPUOffloadConfig, CPUOffloadOptimizer


def test_memory_tensors_name_the_device_state_and_masters() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)]).to(torch.bfloat16)
    params = list(model.parameters())
    opt = CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-3, offload_params=params[4:], master_weights=True,
                              config=CPUOffloadConfig(bucket_bytes=1 << 12, num_staging_slots=2, cpu_threads=1))
    try:
        before = opt.memory_tensors()
        # the masters of the device-resident bf16 parameters exist from the start, in fp32, one per parameter
        assert len(before["master_weights"]) == 4
        assert all(m.dtype == torch.float32 for m in before["master_weights"])
        model(torch.randn(8, 32, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.wait_for_weights()
        after = opt.memory_tensors()
        # Adam's two moments (and its step) for each of the 4 device-resident parameters, none for offloaded ones
        moments = [t for t in after["optimizer_state"] if t.dim() > 0]
        assert len(moments) == 8
        resident = {p.shape for p in params[:4]}
        assert {t.shape for t in moments} == resident
    finally:
        opt.close()
