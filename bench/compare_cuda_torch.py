#!/usr/bin/env python3
"""The PyTorch baseline for compare_cuda, on the same device and the same sizes: the global grad norm
as DeepSpeed computes it (torch._foreach_norm, then the sum of squares on the host), and the unscale
+ cast as a training loop without a fused kernel does it (torch._foreach_mul_ on the fp32 gradients,
then torch._foreach_copy_ into bf16). Timed with CUDA events (the norm with a host clock: it returns
a host float), median of --reps after a warm-up. Last line: one JSON object."""
import argparse
import json
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=1024, help="fp32 working set (MiB)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compare_cuda_torch: needs a CUDA device (torch.cuda.is_available() is False)")
    per = a.mib * 2**20 // 4 // a.tensors
    used = per * a.tensors
    g = torch.Generator(device="cuda").manual_seed(0)
    ts32 = [torch.rand(per, device="cuda", generator=g) * 4 - 2 for _ in range(a.tensors)]
    ts16 = [t.bfloat16() for t in ts32]
    out16 = [torch.empty_like(t) for t in ts16]

    def norm(ts):
        return torch.stack(torch._foreach_norm(ts)).double().square().sum().item()

    def host_timed(fn):
        fn()
        torch.cuda.synchronize()
        s = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            s.append(time.perf_counter() - t0)
        return statistics.median(s)

    def event_timed(fn):
        fn()
        torch.cuda.synchronize()
        s = []
        for _ in range(a.reps):
            b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            b.record()
            fn()
            e.record()
            e.synchronize()
            s.append(b.elapsed_time(e) / 1e3)
        return statistics.median(s)

    ref = sum(float(t.double().square().sum()) for t in ts32)
    got = norm(ts32)
    assert abs(got - ref) / ref < 1e-4, (got, ref)
    t_n32 = host_timed(lambda: norm(ts32))
    t_n16 = host_timed(lambda: norm(ts16))
    work = [t.clone() for t in ts32]

    def scale_cast():
        torch._foreach_mul_(work, 1.0)
        torch._foreach_copy_(out16, work)

    t_sc = event_timed(scale_cast)
    res = {
        "bench": "cuda_torch",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "torch_norm_fp32_gb_s": round(used * 4 / t_n32 / 1e9, 1),
        "torch_norm_bf16_gb_s": round(used * 2 / t_n16 / 1e9, 1),
        # effective bandwidth counted like compare_cuda's fused kernel: 4 B read + 2 B written
        "torch_scale_cast_gb_s": round(used * 6 / t_sc / 1e9, 1),
    }
    print(f"torch {torch.__version__}: norm fp32 {t_n32*1e3:.3f} ms, norm bf16 {t_n16*1e3:.3f} ms, "
          f"foreach mul_+copy_ {t_sc*1e3:.3f} ms")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
