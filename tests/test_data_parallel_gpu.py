"""Data parallel's matmul SM carveout on CUDA (run on the lent GPU). Skipped without CUDA.

Run: ``python -m pytest -m gpu tests/test_data_parallel_gpu.py -q``.

Tolerance: bf16 matmul gradients within 1e-2 relative (norm-wise) of the same backward without the carveout
(cuBLASLt on fewer SMs may choose another kernel and sum in another order).
"""

from __future__ import annotations

import pytest
import torch

from elbowroom.distributed.data_parallel import matmul_sm_carveout

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_carveout_holds_inside_and_is_restored_after() -> None:
    device = torch.device("cuda", 0)
    before = (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library())
    with matmul_sm_carveout(16, device):
        assert torch._C._get_sm_carveout_experimental() == 16
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    assert (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()) == before
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    with pytest.raises(ValueError, match=f"no SM of the {sms}"), matmul_sm_carveout(sms, device):
        pass
    assert (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()) == before


@cuda
def test_backward_under_the_carveout_gives_the_same_gradients() -> None:
    """The autograd engine runs the backward on its device thread: the process-wide carveout reaches it, and the
    gradients are those of a backward without it."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048, bias=False))
    layer.cuda()
    x = torch.randn(4096, 2048, device="cuda")

    def grads(carveout: int) -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = layer(x).float().square().mean()
        with matmul_sm_carveout(carveout, x.device):
            loss.backward()
        return [p.grad.clone() for p in layer.parameters()]

    plain, carved = grads(0), grads(32)
    for a, b in zip(carved, plain):
        assert float((a - b).norm() / b.norm()) <= 1e-2
