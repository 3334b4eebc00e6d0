"""cdist_grad p=2 at the bench size beside torch's einsum and matmul formulations (one run)."""

import statistics

import torch

import kermac_like as km


def timed(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def main():
    L, K, M, N, O = 2, 10000, 10000, 768, 16
    a = torch.randn(L, K, M, device="cuda")
    b = torch.randn(L, N, K, device="cuda")
    c = torch.randn(L, O, K, device="cuda")
    d = torch.randn(L, N, M, device="cuda")
    rows = {
        "kermac_like.cdist_grad": lambda: km.cdist_grad(a, b, c, d, p=2.0),
        "torch.einsum (p=2 identity)": lambda: torch.einsum("lok,lkm,lnm->lonm", c, a, d)
        - torch.einsum("lok,lnk,lkm->lonm", c, b, a),
        "torch matmul (p=2 identity)": lambda: d.unsqueeze(1) * (c @ a).unsqueeze(2)
        - ((c.unsqueeze(2) * b.unsqueeze(1)).reshape(L, O * N, K) @ a).reshape(L, O, N, M),
    }
    for name, fn in rows.items():
        print(f"{name:32s} {timed(fn):8.1f} ms")


if __name__ == "__main__":
    main()
