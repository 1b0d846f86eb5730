# One-off GPU checks run through the device tool on an H100 (torch 2.11), 2026-11-26; logs beside it.
"""Throwaway GPU checks: bf16 through the compiled flex default; RoPE at 1M tokens eager vs compiled."""
import sys, time, torch, traceback
from positional_embeddings import *
dev = torch.device("cuda")
what = sys.argv[1]

def flex_bf16(first_fp32, documents, dynamic=None):
    import positional_embeddings as P
    if dynamic is not None:
        from torch.nn.attention.flex_attention import flex_attention
        P._COMPILED_FLEX[:] = [torch.compile(flex_attention, dynamic=dynamic)]
    torch.manual_seed(0)
    B, H, N, D = 2, 8, 1000, 64
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate([300, 1, 450, 249])]).to(dev) if documents else None
    pe = T5PositionalEmbedding(H).to(dev)
    q, k, v = (torch.randn(B, H, N, D, device=dev) for _ in range(3))
    if first_fp32:
        attention(q, k, v, pe, causal=True, document_ids=ids)
    try:
        got = attention(*(t.bfloat16() for t in (q, k, v)), pe, causal=True, document_ids=ids)
        want = attention(q.double(), k.double(), v.double(), pe.double(), causal=True, document_ids=ids, use_flex=False)
        print(f"T5 bf16 flex (fp32 first={first_fp32}, documents={documents}, dynamic={dynamic}): "
              f"max err vs float64 dense {(got.double() - want).abs().max().item():.2e}")
    except Exception as e:
        print(f"T5 bf16 flex (fp32 first={first_fp32}, documents={documents}, dynamic={dynamic}): FAILED "
              f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")

def rope():
    N, D = 1 << 20, 128
    pe = RotaryPositionalEmbedding(D).to(dev)
    qb = torch.randn(1, 8, N // 8, D, device=dev).bfloat16()
    compiled = torch.compile(lambda q, k: pe.encode_qk(q, k))
    def t(fn, reps=20):
        fn(); fn(); torch.cuda.synchronize(); s = time.perf_counter()
        for _ in range(reps): fn()
        torch.cuda.synchronize(); return (time.perf_counter() - s) / reps
    tc = t(lambda: (qb.clone(), qb.clone()))
    te = t(lambda: pe.encode_qk(qb, qb)); tk = t(lambda: compiled(qb, qb))
    torch.testing.assert_close(compiled(qb, qb)[0], pe.encode_qk(qb, qb)[0])
    print(f"RoPE bf16 [1, 8, 2^17, 128] q and k: eager {te*1e3:.3f} ms ({te/tc:.2f} x clone), "
          f"compiled {tk*1e3:.3f} ms ({tk/tc:.2f} x clone), clone {tc*1e3:.3f} ms")

if what == "rope": rope()
elif what == "a": flex_bf16(False, False)
elif what == "b": flex_bf16(True, True)
elif what == "c": flex_bf16(True, True, dynamic=False)
