"""Do two versions of the library compute the same numbers? Record every test case's outputs, then compare.

    python benchmarks/same_outputs.py record DIR OUT.pt      # DIR holds the positional_embeddings.py to record
    python benchmarks/same_outputs.py compare A.pt B.pt      # prints every output that is not bitwise equal;
                                                             # exit status 1 when any differs

Per case of the test file's ``CASES`` (same seeds): the class's own call, ``forward_attn``,
``attention()`` with default and with explicit (permuted) positions, ``attention(use_flex=True)``
for biases, ``forward_input`` for input kinds. ``DTYPE=bfloat16`` feeds bf16 inputs,
``DTYPE=float64`` a float64 module and inputs. An error is recorded as its message, so changed
messages show too. The cases come from this repository's test file, so the recorded library must
define every name that test file imports (record an older version with the test file of its time).
"""
import os
import pathlib
import sys

import torch


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN (``torch.equal`` counts NaN != NaN); infinities must match in sign."""
    nan = torch.isnan(x)
    return torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan])


def describe(x: torch.Tensor, y: torch.Tensor) -> str:
    finite = torch.isfinite(x) & torch.isfinite(y)
    pattern = torch.equal(torch.isinf(x), torch.isinf(y)) and torch.equal(torch.isnan(x), torch.isnan(y))
    if not finite.any():
        return f"no finite pair; inf / nan pattern same {pattern}"
    diff = (x - y)[finite].abs()
    ulps = (diff / torch.finfo(x.dtype).eps / x[finite].abs().clamp_min(torch.finfo(x.dtype).tiny)).max().item()
    return f"max |diff| {diff.max().item():.3g}, max rel/eps {ulps:.2f}, inf / nan pattern same {pattern}"


def compare(path_a: str, path_b: str) -> int:
    """Print every output that is missing, differs in shape or message, or is not bitwise equal; return their count."""
    a, b = torch.load(path_a), torch.load(path_b)
    found = 0
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            problem = f"missing {key}: in A {x is not None}, in B {y is not None}"
        elif isinstance(x, str) or isinstance(y, str):
            problem = None if x == y else f"differs {key}: {str(x)[:80]} | {str(y)[:80]}"
        elif x.shape != y.shape or x.dtype != y.dtype:
            problem = f"shape {key}: {tuple(x.shape)} {x.dtype} | {tuple(y.shape)} {y.dtype}"
        else:
            problem = None if same(x, y) else f"not bitwise {key}: {describe(x, y)}"
        if problem:
            print(problem)
            found += 1
    print(f"compared {len(set(a) & set(b))} outputs: {found} differ")
    return found


if sys.argv[1] == "compare":
    sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
directory, target = sys.argv[2], sys.argv[3]
sys.path.insert(0, directory)
import positional_embeddings as lib  # noqa: E402
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))   # the repository: its test file's CASES
import test_positional_embeddings as T  # noqa: E402
assert pathlib.Path(lib.__file__).resolve().parent == pathlib.Path(directory).resolve(), lib.__file__
out = {}
def put(key, fn):
    try:
        out[key] = fn().detach().clone()
    except Exception as e:
        out[key] = f"{type(e).__name__}: {e}"
for case in T.CASES:
    torch.manual_seed(0)
    pe = case.make()
    torch.manual_seed(1)
    dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
    if dtype == torch.float64:
        pe = pe.double()
    q, k, v = (t.to(dtype) for t in T.qkv(T.N - 3, T.N))
    x = T.tokens(case).to(dtype)
    pos = case.positions(q.shape[-2], k.shape[-2])
    put(f"{case.name}/own", lambda: (lambda r: r if isinstance(r, torch.Tensor) else torch.cat([t.flatten() for t in r]))(pe(*case.own_call_args(pe, q, k, x))))
    if pe.kind != "input":
        put(f"{case.name}/attn", lambda: case.attn(pe, q, k))
        put(f"{case.name}/attention", lambda: lib.attention(q, k, v, pe, positions_q=pos[0], positions_k=pos[1],
                                                            causal=True if pe.is_causal else None))
        if pe.takes_positions and case.required_positions is None:
            pq, pk = torch.tensor([5, 2, 9, 9, 0, 1, 7, 3, 3, 12, 11, 4, 8])[: q.shape[-2]], torch.arange(k.shape[-2]).flip(0)
            if case.name not in ("relpos2d", "relpos2d_cls", "cpb"):
                put(f"{case.name}/explicit", lambda: lib.attention(q, k, v, pe, positions_q=pq, positions_k=pk,
                                                                   causal=True if pe.is_causal else None))
        if pe.kind == "bias":
            put(f"{case.name}/flex", lambda: lib.attention(q, k, v, pe, positions_q=pos[0], positions_k=pos[1],
                                                           causal=True if pe.is_causal else None, use_flex=True))
    else:
        put(f"{case.name}/input", lambda: pe.forward_input(x, None if case.required_positions is None else case.required_positions(x.shape[-2])))
torch.save(out, target)
print(len(out), "outputs recorded")
