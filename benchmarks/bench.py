"""Speed and memory of positional_embeddings.py, as ratios to baselines measured in the same run.

Not a test: wall-clock numbers on shared machines are noisy, so every figure is the median
of interleaved repetitions and is reported as a ratio to a floor or a peer timed in the
same loop. Peers (Hugging Face transformers, torchtune, ...) are skipped when absent.

    python benchmarks/bench.py                 # everything
    python benchmarks/bench.py rope --reps 50  # one section
    python benchmarks/bench.py rope_attention --reps 3 --regime "reused memory"   # issue 42's RoPE size, CPU
    python benchmarks/bench.py all --only rotary,alibi   # a few encodings against the floor
    python benchmarks/bench.py gqa             # grouped-query attention against repeated k/v (time, peak memory)
    python benchmarks/bench.py bias_paths      # bias encodings on the CPU: eager dense, compiled flex, compiled
                                               # attention(), compiled dense; T5 at 32768 tokens (peak memory)
    python benchmarks/bench.py gpu --regime "reused memory"   # the GPU table (says "no GPU" without one)

glibc's malloc decides, from its history, whether a large tensor gets fresh pages (the
kernel zero-fills them on first touch, which can cost more than the arithmetic) or reuses
freed memory, so one process can swing 3x between runs. The script therefore runs every
section twice, in child processes with the allocator pinned: "fresh pages"
(``MALLOC_MMAP_THRESHOLD_=131072``: every large tensor is a new mapping, as for tensors
over 32 MiB by default) and "reused memory" (large threshold: no page faults after warm-up,
like PyTorch's caching allocators on GPU).
"""

import argparse
import importlib
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import positional_embeddings as pe_lib  # noqa: E402

warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------


def medians(fns: dict, reps: int, warmup: int = 3) -> dict:
    """Median seconds of each function, timed in interleaved rounds so drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def peak_memory(fn) -> int:
    """Peak bytes of tensors allocated (and not yet freed) while ``fn`` runs.

    Read from the PyTorch profiler's allocation events, so it does not depend on whether
    the allocator hands out fresh pages or reuses memory (resident-set figures do).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def optional(module: str, file: str = None):
    """A peer module, or None when it is not installed (or fails to import).

    ``file`` loads one file of the package without running its ``__init__`` (torchtune's
    imports torchao, which may not match the installed torch).
    """
    try:
        if file is None:
            return importlib.import_module(module)
        spec = importlib.util.find_spec(module)
        path = os.path.join(os.path.dirname(spec.origin), file)
        loaded = importlib.util.module_from_spec(importlib.util.spec_from_file_location(f"_peer_{module}", path))
        loaded.__spec__.loader.exec_module(loaded)
        return loaded
    except Exception:
        return None


def report(title: str, times: dict, baseline: str, memory: dict = None) -> None:
    print(f"\n{title}")
    print(f"  {'implementation':<52}{'median ms':>10}{'ratio':>8}" + (f"{'peak MiB':>11}" if memory else ""))
    for name, t in times.items():
        line = f"  {name:<52}{t * 1e3:>10.2f}{t / times[baseline]:>8.2f}"
        if memory:
            line += f"{memory.get(name, float('nan')) / 2**20:>11.1f}"
        print(line)


# ---------------------------------------------------------------------------
# Rotary
# ---------------------------------------------------------------------------


def bench_rope(reps: int, compile: bool, sizes: tuple = (1, 32, 2048, 128)) -> None:
    b, h, n, d = sizes
    q, k = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    device = q.device
    fns = {"clone q and k (memory-traffic floor)": lambda: (q.clone(), k.clone())}
    half, inter = pe_lib.RotaryPositionalEmbedding(d), pe_lib.RotaryPositionalEmbedding(d, interleaved=True)
    fns["ours, half-split (eager)"] = lambda: (half(q), half(k))
    fns["ours, interleaved (eager)"] = lambda: (inter(q), inter(k))
    if compile:
        compiled = torch.compile(half, dynamic=False)
        compiled_inter = torch.compile(inter, dynamic=False)
        fns["ours, half-split (torch.compile)"] = lambda: (compiled(q), compiled(k))
        fns["ours, interleaved (torch.compile)"] = lambda: (compiled_inter(q), compiled_inter(k))
    llama = optional("transformers.models.llama.modeling_llama")
    if llama is not None:
        config = optional("transformers").LlamaConfig(hidden_size=h * d, num_attention_heads=h, head_dim=d)
        cos, sin = llama.LlamaRotaryEmbedding(config).to(device)(q, torch.arange(n, device=device)[None])
        fns["Hugging Face apply_rotary_pos_emb"] = lambda: llama.apply_rotary_pos_emb(q, k, cos, sin)
    tune = optional("torchtune", "modules/position_embeddings.py")
    if tune is not None:
        tune_rope = tune.RotaryPositionalEmbeddings(d, max_seq_len=4096)
        qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()   # torchtune: [b, s, h, d]
        fns["torchtune RotaryPositionalEmbeddings"] = lambda: (tune_rope(qt), tune_rope(kt))
    ret = optional("rotary_embedding_torch")
    if ret is not None:
        rotary = ret.RotaryEmbedding(d).to(device)
        fns["rotary-embedding-torch rotate_queries_or_keys"] = lambda: (rotary.rotate_queries_or_keys(q),
                                                                        rotary.rotate_queries_or_keys(k))
    report(f"RoPE: rotate q and k [{b}, {h}, {n}, {d}] fp32", medians(fns, reps), baseline=next(iter(fns)))


def hf_rope_tables(n: int, d: int, dtype: torch.dtype, device=None) -> tuple:
    """cos, sin ``[N, Dh]`` of the Hugging Face-style rotation (``rotate_half``), in the input dtype as HF keeps them."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq                # [N, Dh/2]
    both = torch.cat([angles, angles], dim=-1)                                                       # [N, Dh]
    return both.cos().to(dtype), both.sin().to(dtype)


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``: what a user writes instead of the library (the issue-42 anchor)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def bench_rope_attention(reps: int, compile: bool, sizes: tuple = (2, 16, 4096, 128)) -> None:
    """RoPE through attention() against plain SDPA and the HF-style rotation + SDPA, forward (no grad) and
    forward + backward, causal, fp32 and bf16 (issue 42's size: B=2, H=16, N=4096, Dh=128); with ``compile``
    also attention() through the rotation the library compiles for CUDA, here run by inductor on the CPU
    (its first call compiles, outside the timing)."""
    b, h, n, d = sizes
    reps = max(1, reps // 10) if n * d >= 2**19 else reps   # one SDPA takes seconds on a CPU at the size
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rope = pe_lib.RotaryPositionalEmbedding(d)
    fused = pe_lib._FUSED_ROTATION_DEVICES

    def with_fused(fn):   # the CUDA default path, taken on this device for the call
        def call(*args):
            pe_lib._FUSED_ROTATION_DEVICES = (*fused, args[0].device.type)
            try:
                return fn(*args)
            finally:
                pe_lib._FUSED_ROTATION_DEVICES = fused
        return call

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for _ in range(3))
        cos, sin = hf_rope_tables(n, d, dtype)
        rows = {"SDPA causal (floor: no positions)": lambda q, k, v: sdpa(q, k, v, is_causal=True),
                "RoPE attention() (eager rotation: the CPU's default)":
                    lambda q, k, v: pe_lib.attention(q, k, v, rope, causal=True),
                "HF-style rotate_half + SDPA": lambda q, k, v: sdpa(hf_rope(q, cos, sin), hf_rope(k, cos, sin), v,
                                                                    is_causal=True)}
        if compile:
            rows["RoPE attention(), compiled rotation (CUDA's default)"] = with_fused(
                lambda q, k, v: pe_lib.attention(q, k, v, rope, causal=True))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        grad = torch.randn_like(q)

        def forward(fn):
            def call():
                with torch.no_grad():
                    fn(q, k, v)
            return call

        def training(fn):
            def step():
                fn(*leaves).backward(grad)
                for t in leaves:
                    t.grad = None
            return step

        name = str(dtype).replace("torch.", "")
        for mode, wrap in (("forward (no grad)", forward), ("forward + backward", training)):
            times = medians({row: wrap(fn) for row, fn in rows.items()}, reps, warmup=1)
            report(f"RoPE attention, {mode}, B={b}, H={h}, N={n}, Dh={d} {name}, causal (ratio to SDPA)",
                   times, next(iter(times)))


def _rope_float64(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Half-split RoPE of x [..., N, D] computed entirely in float64 (the reference)."""
    d = x.shape[-1]
    inv_freq = base ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = x.double()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def bench_rope_precision(reps: int, compile: bool) -> None:
    """Max |error| against float64 at positions near 1e6, fp32 and bf16 inputs."""
    d, base = 128, 10000.0
    positions = torch.arange(1_000_000 - 64, 1_000_000)
    x = torch.randn(1, 8, 64, d, generator=torch.Generator().manual_seed(0))   # the same input every run
    rows, want = {}, {}
    ours = pe_lib.RotaryPositionalEmbedding(d, base=base)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        want[dtype] = _rope_float64(xd, positions, base)  # exact rotation of the (rounded) input
        rows.setdefault("ours", {})[dtype] = ours(xd, positions)
        llama = optional("transformers.models.llama.modeling_llama")
        if llama is not None:
            config = optional("transformers").LlamaConfig(hidden_size=8 * d, num_attention_heads=8, head_dim=d)
            cos, sin = llama.LlamaRotaryEmbedding(config)(xd, positions[None])
            rows.setdefault("Hugging Face (Llama)", {})[dtype] = llama.apply_rotary_pos_emb(xd, xd, cos, sin)[0]
        tune = optional("torchtune", "modules/position_embeddings.py")
        if tune is not None:
            rope = tune.RotaryPositionalEmbeddings(d, max_seq_len=1_000_000, base=base)
            perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # interleaved -> half-split rows
            inverse = torch.argsort(perm)
            out = rope(xd[..., inverse].transpose(1, 2), input_pos=positions[None]).transpose(1, 2)
            rows.setdefault("torchtune", {})[dtype] = out[..., perm]
    exact = want[torch.bfloat16]
    rounding = (exact.to(torch.bfloat16).double() - exact).abs().max().item()
    print(f"\nRoPE precision at positions 999,936 .. 999,999 (max |error| vs float64; outputs ~1;"
          f" rounding the exact result to bf16 costs {rounding:.1e})")
    print(f"  {'implementation':<30}{'fp32':>12}{'bf16':>12}")
    for name, by_dtype in rows.items():
        errors = [(by_dtype[t].double() - want[t]).abs().max().item() for t in (torch.float32, torch.bfloat16)]
        print(f"  {name:<30}{errors[0]:>12.1e}{errors[1]:>12.1e}")


# ---------------------------------------------------------------------------
# Attention biases
# ---------------------------------------------------------------------------


def bench_t5(reps: int, compile: bool) -> None:
    h, n = 8, 4096
    t5 = pe_lib.T5PositionalEmbedding(h)
    row = torch.randn(h, 1, n)
    fns = {"write [8, 4096, 4096] (expand().contiguous())": lambda: row.expand(h, n, n).contiguous(),
           "ours T5PositionalEmbedding(4096, 4096)": lambda: t5(n, n)}
    t5_module = optional("transformers.models.t5.modeling_t5")
    if t5_module is not None:
        config = optional("transformers").T5Config(num_heads=h, d_model=512, d_kv=64)
        hf = t5_module.T5Attention(config, has_relative_attention_bias=True)
        fns["Hugging Face T5Attention.compute_bias"] = lambda: hf.compute_bias(n, n)
    xt = optional("x_transformers.x_transformers")
    if xt is not None:
        x_bias = xt.RelativePositionBias(scale=1.0, heads=h)
        fns["x-transformers RelativePositionBias"] = lambda: x_bias(n, n)
    report(f"T5 bias: build [{h}, {n}, {n}] fp32", medians(fns, max(3, reps // 6)), baseline=next(iter(fns)))

    alibi = pe_lib.ALiBiPositionalEmbedding(h)
    fns = {"write [8, 4096, 4096] (expand().contiguous())": lambda: row.expand(h, n, n).contiguous(),
           "ours ALiBiPositionalEmbedding(4096, 4096)": lambda: alibi(n, n)}
    if xt is not None:
        x_alibi = xt.AlibiPositionalBias(heads=h)
        fns["x-transformers AlibiPositionalBias (returns its cached table)"] = lambda: x_alibi(n, n)
    report(f"ALiBi bias: build [{h}, {n}, {n}] fp32", medians(fns, max(3, reps // 6)), baseline=next(iter(fns)))


# ---------------------------------------------------------------------------
# Heinsen
# ---------------------------------------------------------------------------


def heinsen_reference(module, x: torch.Tensor) -> torch.Tensor:
    """The reference algorithm: one cumsum + logcumsumexp over the sequence, zero state first."""
    log_p, h = module.H(x).split(module.d_hid, dim=-1)
    log_p = torch.nn.functional.logsigmoid(log_p)
    a = torch.nn.functional.pad(log_p.cumsum(dim=-2), (0, 0, 1, 0))
    prepended = torch.nn.functional.pad(h, (0, 0, 1, 0))
    s = (a + torch.logcumsumexp(prepended - a, dim=-2))[..., 1:, :]
    return x + module.R(s)


def bench_heinsen(reps: int, compile: bool) -> None:
    b, n, d = 8, 4096, 512
    ours = pe_lib.HeinsenPositionalEmbedding(d, d)
    x = torch.randn(b, n, d)
    xg = x.clone().requires_grad_(True)

    def train_step(fn):
        def step():
            fn(xg).sum().backward()
            xg.grad = None
            ours.zero_grad(set_to_none=True)
        return step

    fns = {"reference algorithm, forward": lambda: heinsen_reference(ours, x).detach(),
           "ours, forward": lambda: ours(x).detach(),
           "reference algorithm, forward + backward": train_step(lambda t: heinsen_reference(ours, t)),
           "ours, forward + backward": train_step(ours)}
    with torch.no_grad():
        forward = {name: fn for name, fn in fns.items() if "backward" not in name}
        times = medians(forward, max(3, reps // 6))
        memory = {name: peak_memory(fn) for name, fn in forward.items()}
    report(f"Heinsen: B={b}, N={n}, d_emb=d_hid={d} fp32, no grad", times, next(iter(times)), memory)
    training = {name: fn for name, fn in fns.items() if "backward" in name}
    times = medians(training, max(3, reps // 6))
    memory = {name: peak_memory(fn) for name, fn in training.items()}
    report(f"Heinsen: B={b}, N={n}, d_emb=d_hid={d} fp32, forward + backward", times, next(iter(times)), memory)


def bench_heinsen_precision(reps: int, compile: bool) -> None:
    """Max |error| against the reference algorithm run in float64 (~1e-10 from exact)."""
    torch.manual_seed(0)
    d = 64
    module = pe_lib.HeinsenPositionalEmbedding(d, d)
    print(f"\nHeinsen precision: max |y - exact| (d_emb = d_hid = {d}, B = 1; outputs' max |y| in brackets)")
    print(f"  {'N':>9}{'ours fp32':>12}{'reference fp32':>16}{'ours bf16':>12}{'reference bf16':>16}")
    for n in (1_000, 100_000, 1_000_000):
        x = torch.randn(1, n, d)
        with torch.no_grad():
            exact = heinsen_reference(module.double(), x.double())
            module.float()
            row = [ours_error := (module(x).double() - exact).abs().max().item(),
                   (heinsen_reference(module, x).double() - exact).abs().max().item()]
            if n <= 100_000:  # bf16 against the exact result of the bf16-rounded weights and input
                module.bfloat16()
                xb = x.bfloat16()
                exact_b = heinsen_reference(module.double(), xb.double())
                module.bfloat16()
                row += [(module(xb).double() - exact_b).abs().max().item(),
                        (heinsen_reference(module, xb).double() - exact_b).abs().max().item()]
                module.float()
            else:
                row += [float("nan"), float("nan")]
        cells = "".join(f"{v:>12.1e}" if i % 2 == 0 else f"{v:>16.1e}" for i, v in enumerate(row))
        print(f"  {n:>9}{cells}   [{exact.abs().max().item():.1f}]")
        del ours_error


# ---------------------------------------------------------------------------
# Algebraic (APE)
# ---------------------------------------------------------------------------


def naive_algebraic(primitives: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple:
    """The reference's approach: W^p for every position by repeated doubling, then each token's
    matrix gathered by its position id ([B, N] ids, as the reference indexes ``maps[position_ids]``)."""
    b, n = q.shape[0], q.shape[-2]
    maps = primitives.unsqueeze(0)                                                    # [1, H, Dh, Dh]
    while maps.shape[0] < n:
        maps = torch.cat([maps, maps @ maps[-1]], dim=0)                                # W^1 .. W^(2m)
    eye = torch.eye(primitives.shape[-1], dtype=primitives.dtype, device=primitives.device).expand_as(primitives)
    maps = torch.cat([eye[None], maps[: n - 1]], dim=0)                                 # W^0 .. W^(n-1): [N, H, Dh, Dh]
    gathered = maps[torch.arange(n).expand(b, n)]                                       # [B, N, H, Dh, Dh]
    apply = lambda x: torch.einsum("bnhij,bhnj->bhni", gathered, x)
    return apply(q), apply(k)


def reference_rope_like_init(dim: int, steps: int = 10_000) -> torch.Tensor:
    """The reference's initialisation: scipy's logm of a RoPE matrix, then AdamW fits P - P^T to it."""
    from scipy.linalg import logm

    angles = torch.tensor([1 / (10000 ** (2 * (j // 2) / (dim // 2))) for j in range(dim // 2)])
    rope = torch.block_diag(*[torch.tensor([[a.cos(), a.sin()], [-a.sin(), a.cos()]]) for a in angles])
    target = torch.tensor(logm(rope.numpy()).real)
    base = torch.rand_like(target, requires_grad=True)
    optimiser = torch.optim.AdamW([base], lr=1e-3)
    for _ in range(steps):
        loss = torch.norm(target - (base - base.mT)) ** 2
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
    return base.detach()


def bench_algebraic(reps: int, compile: bool) -> None:
    b, h, n, d = 4, 8, 1024, 64
    ape = pe_lib.AlgebraicSequencePositionalEmbedding(d, h).to(device)
    with torch.no_grad():
        ape.set_primitives(torch.matrix_exp((lambda p: p - p.mT)(torch.randn(h, d, d) * 0.1)))
        primitives = ape.primitives
    q, k = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    fns = {"naive: W^p per position (repeated doubling)": lambda: naive_algebraic(primitives, q, k),
           "ours: basis change + rotation": lambda: ape.encode_qk(q, k)}
    with torch.no_grad():
        times = medians(fns, max(3, reps // 3))
        memory = {name: peak_memory(fn) for name, fn in fns.items()}
        exact = pe_lib.AlgebraicSequencePositionalEmbedding(d, h).double()
        exact.load_state_dict(ape.state_dict())                                          # same parameters, float64 W
        want, got = naive_algebraic(exact.primitives, q.double(), k.double()), ape.encode_qk(q, k)
        scores_want = want[0] @ want[1].transpose(-1, -2)
        scores_got = got[0] @ got[1].transpose(-1, -2)
    report(f"Algebraic sequence: transform q and k, B={b}, H={h}, N={n}, Dh={d} fp32 (ours vs float64 W^p: "
           f"max |score error| {(scores_got.double() - scores_want).abs().max().item():.1e} on scores up to "
           f"{scores_want.abs().max().item():.0f})",
           times, next(iter(times)), memory)
    init = {"ours: AlgebraicSequencePositionalEmbedding(64, 8)": lambda: pe_lib.AlgebraicSequencePositionalEmbedding(d, h)}
    if optional("scipy.linalg") is not None:
        init["reference init: logm + 10,000 AdamW steps"] = lambda: reference_rope_like_init(d)
    times = medians(init, 1, warmup=0)
    print(f"\n  init time: " + ", ".join(f"{name}: {t * 1e3:.1f} ms" for name, t in times.items()))


# ---------------------------------------------------------------------------
# Every class in one table
# ---------------------------------------------------------------------------


def _peer_attentions(q, k, v, x, h: int, d: int, n: int) -> dict:
    """Peer implementations of the same attention, where installed: name -> (q, k, v, x) -> out."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    device = q.device
    peers = {}
    llama = optional("transformers.models.llama.modeling_llama")
    if llama is not None:
        config = optional("transformers").LlamaConfig(hidden_size=h * d, num_attention_heads=h, head_dim=d)
        cos, sin = llama.LlamaRotaryEmbedding(config).to(device)(q, torch.arange(n, device=device)[None])
        peers["Hugging Face RoPE + SDPA"] = lambda q, k, v, x: sdpa(*llama.apply_rotary_pos_emb(q, k, cos, sin), v,
                                                                   is_causal=True)
    tune = optional("torchtune", "modules/position_embeddings.py")
    if tune is not None:
        rope = tune.RotaryPositionalEmbeddings(d, max_seq_len=n).to(device)
        turn = lambda t: rope(t.transpose(1, 2)).transpose(1, 2)                          # torchtune: [b, s, h, d]
        peers["torchtune RoPE + SDPA"] = lambda q, k, v, x: sdpa(turn(q), turn(k), v, is_causal=True)
    ret = optional("rotary_embedding_torch")
    if ret is not None:
        rotary = ret.RotaryEmbedding(d).to(device)
        peers["rotary-embedding-torch + SDPA"] = lambda q, k, v, x: sdpa(rotary.rotate_queries_or_keys(q),
                                                                        rotary.rotate_queries_or_keys(k), v, is_causal=True)
    xt = optional("x_transformers.x_transformers")
    if xt is not None:
        t5_bias, alibi = xt.RelativePositionBias(scale=1.0, heads=h).to(device), xt.AlibiPositionalBias(heads=h).to(device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
        peers["x-transformers T5 bias + SDPA"] = lambda q, k, v, x: sdpa(q, k, v, attn_mask=t5_bias(n, n))
        peers["x-transformers ALiBi + SDPA"] = lambda q, k, v, x: sdpa(
            q, k, v, attn_mask=alibi(n, n).masked_fill(causal, float("-inf")))
    heinsen = pe_lib.HeinsenPositionalEmbedding(h * d, h * d).to(device)
    peers["Heinsen reference algorithm + SDPA"] = lambda q, k, v, x: (heinsen_reference(heinsen, x), sdpa(q, k, v))
    ape = pe_lib.AlgebraicSequencePositionalEmbedding(d, h).to(device)
    peers["APE naive W^p + SDPA"] = lambda q, k, v, x: sdpa(*naive_algebraic(ape.primitives, q, k), v, is_causal=True)
    return peers


ONLY = set()   # --only: the demo entries to time (empty: all, with the peer libraries)


def _demo_entries(h: int, d: int, n: int) -> dict:
    """The library's demo encodings at these sizes, or those --only names."""
    return {name: pe for name, pe in pe_lib._demo_modules(h, d, n).items() if not ONLY or name in ONLY}


def bench_all(reps: int, compile: bool) -> None:
    b, h, n, d = 2, 8, 1024, 64
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    x = torch.randn(b, n, h * d, requires_grad=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {"plain SDPA, causal (floor: no positions)": lambda q, k, v, x: sdpa(q, k, v, is_causal=True)}
    for name, pe in _demo_entries(h, d, n).items():
        positions = pe_lib._demo_positions(pe, n)
        if pe.kind == "input":
            calls[f"{name} (forward_input + SDPA)"] = lambda q, k, v, x, pe=pe, p=positions: (
                pe.forward_input(x, p), sdpa(q, k, v, is_causal=True))
        else:
            calls[name] = lambda q, k, v, x, pe=pe, p=positions: pe_lib.attention(
                q, k, v, pe, positions_q=p, positions_k=p, causal=p is None)
    if not ONLY:   # --only times the named entries against the floor, no peers
        calls.update(_peer_attentions(q, k, v, x, h, d, n))

    def total(out):
        return sum(t.float().sum() for t in (out if isinstance(out, tuple) else (out,)))

    def training(fn):
        def step():
            total(fn(q, k, v, x)).backward()
            for t in (q, k, v, x):
                t.grad = None
        return step

    with torch.no_grad():
        forward = {name: (lambda fn=fn: fn(q, k, v, x)) for name, fn in calls.items()}
        times = medians(forward, max(3, reps // 3))
        memory = {name: peak_memory(fn) for name, fn in forward.items()}
    report(f"Every encoding: attention forward, B={b}, H={h}, N={n}, Dh={d} fp32 (ratio to plain SDPA)",
           times, next(iter(times)), memory)
    train = {name: training(fn) for name, fn in calls.items()}
    times = medians(train, max(3, reps // 3))
    memory = {name: peak_memory(fn) for name, fn in train.items()}
    report(f"Every encoding: attention forward + backward, B={b}, H={h}, N={n}, Dh={d} fp32",
           times, next(iter(times)), memory)


def bench_gqa(reps: int, compile: bool) -> None:
    """Grouped-query attention (32 query heads, 8 key/value heads) against repeating k and v."""
    b, hq, hkv, n, d = 1, 32, 8, 2048, 128
    q = torch.randn(b, hq, n, d, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, d, requires_grad=True) for _ in range(2))
    group = hq // hkv
    encodings = {"RoPE": pe_lib.RotaryPositionalEmbedding(d), "ALiBi": pe_lib.ALiBiPositionalEmbedding(hq),
                 "T5": pe_lib.T5PositionalEmbedding(hq)}
    calls = {}
    for name, pe in encodings.items():
        calls[f"{name}: attention(q, k, v) with {hkv} kv heads"] = \
            lambda pe=pe: pe_lib.attention(q, k, v, pe, causal=True)
        calls[f"{name}: k, v repeated to {hq} heads first"] = \
            lambda pe=pe: pe_lib.attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), pe,
                                           causal=True)

    def training(fn):
        def step():
            fn().float().sum().backward()
            for t in (q, k, v):
                t.grad = None
        return step

    title = f"Grouped-query attention, B={b}, Hq={hq}, Hkv={hkv}, N={n}, Dh={d} fp32, causal"
    with torch.no_grad():
        times = medians(calls, max(3, reps // 3))
        memory = {name: peak_memory(fn) for name, fn in calls.items()}
    report(f"{title}: forward (ratio to the first row)", times, next(iter(times)), memory)
    train = {name: training(fn) for name, fn in calls.items()}
    times = medians(train, max(3, reps // 3))
    memory = {name: peak_memory(fn) for name, fn in train.items()}
    report(f"{title}: forward + backward", times, next(iter(times)), memory)


def _bias_encodings(h: int) -> dict:
    return {"T5": pe_lib.T5PositionalEmbedding(h), "ALiBi": pe_lib.ALiBiPositionalEmbedding(h),
            "KERPLE": pe_lib.KerplePositionalEmbedding(h), "FIRE": pe_lib.FIREPositionalEmbedding(h)}


def bench_bias_paths(reps: int, compile: bool) -> None:
    """A bias encoding's attention, no grad, causal (ratios to SDPA causal): attention()'s eager
    dense bias (the CPU default), ``flex_attention`` compiled once (the library's
    ``_compiled_flex_attention``, the CUDA default in eager mode) with a causal block mask built once
    outside the timing, without a score_mod (the kernel's own cost: the floor of every flex row) and
    with the encoding's score_mod, attention() compiled whole with its
    defaults (FlexAttention for T5, ALiBi and KERPLE: their score_mod reads the module's own tensors,
    which inductor's CPU kernel takes; the dense bias for FIRE) and compiled whole with the dense
    bias (``use_flex=False``). Then T5 at 32768 tokens through attention()'s defaults, eager: the dense
    bias built a block of queries at a time (the whole ``[8, 32768, 32768]`` float32 bias is 32 GiB)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    b, h, d = 1, 8, 64
    for n, names in ((1024, ("T5", "ALiBi", "KERPLE", "FIRE")), (8192, ("T5",))):
        q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
        calls = {"SDPA causal (no positions)": lambda: sdpa(q, k, v, is_causal=True)}
        if compile:   # the CPU kernel's own cost: compiled flex_attention with the causal block mask and no score_mod
            torch._dynamo.reset()
            flex, mask = pe_lib._compiled_flex_attention(), pe_lib._block_mask(None, True, n, n, q.device)
            calls["compiled flex_attention, no score_mod"] = lambda flex=flex, mask=mask: flex(
                q, k, v, block_mask=mask, scale=d ** -0.5)
        for name in names:
            pe = _bias_encodings(h)[name]
            calls[f"{name}: eager, dense bias"] = lambda pe=pe: pe_lib.attention(q, k, v, pe, causal=True,
                                                                                 use_flex=False)
            if compile:
                torch._dynamo.reset()
                flex, mask = pe_lib._compiled_flex_attention(), pe_lib._block_mask(None, True, n, n, q.device)
                default = torch.compile(lambda q, k, v, pe=pe: pe_lib.attention(q, k, v, pe, causal=True),
                                        dynamic=False)
                dense = torch.compile(lambda q, k, v, pe=pe: pe_lib.attention(q, k, v, pe, causal=True,
                                                                              use_flex=False), dynamic=False)
                calls[f"{name}: compiled flex_attention + score_mod"] = lambda pe=pe: flex(
                    q, k, v, score_mod=pe.score_mod(n, n), block_mask=mask, scale=d ** -0.5)
                calls[f"{name}: compiled attention(), defaults"] = lambda f=default: f(q, k, v)
                calls[f"{name}: compiled, dense bias"] = lambda f=dense: f(q, k, v)
        with torch.no_grad():
            times = medians(calls, max(3, reps // 3))
            memory = {name: peak_memory(fn) for name, fn in calls.items()}
        report(f"Bias encodings, attention() paths: forward, no grad, B={b}, H={h}, N={n}, Dh={d} fp32, causal "
               f"(ratio to SDPA causal)", times, next(iter(times)), memory)
    n = 32768
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    t5 = pe_lib.T5PositionalEmbedding(h, bidirectional=False)
    calls = {"SDPA causal (no positions)": lambda: sdpa(q, k, v, is_causal=True),
             "T5: attention(), defaults (dense bias, query blocks)": lambda: pe_lib.attention(q, k, v, t5)}
    with torch.no_grad():
        times = medians(calls, 1, warmup=0)
        memory = {name: peak_memory(fn) for name, fn in calls.items()}
    report(f"T5 at N={n}: forward, no grad, B={b}, H={h}, Dh={d} fp32, causal, one call each (the whole dense bias "
           f"would be {h * n * n * 4 / 2**30:.0f} GiB)", times, next(iter(times)), memory)


def bench_gpu(reps: int, compile: bool) -> None:
    """Every encoding on the GPU: forward and forward + backward through attention()'s default path
    and, for biases, FlexAttention (compiled once); ratios to SDPA and to the peers. Prints "no GPU"
    and returns on a machine without CUDA."""
    if not torch.cuda.is_available():
        print("\nbench.py gpu: no GPU (torch.cuda.is_available() is False); nothing measured")
        return
    device = torch.device("cuda")
    # every bias class is a new score_mod for the one compiled flex_attention, and grad mode doubles them:
    # past dynamo's limit (8 by default) torch would time the unfused eager kernel instead
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 256)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    b, h, n, d = 2, 8, 4096, 64
    q, k, v = (torch.randn(b, h, n, d, device=device, requires_grad=True) for _ in range(3))
    x = torch.randn(b, n, h * d, device=device, requires_grad=True)
    calls = {"plain SDPA, causal (floor: no positions)": lambda q, k, v, x: sdpa(q, k, v, is_causal=True)}
    for name, pe in _demo_entries(h, d, n).items():
        pe = pe.to(device)
        positions = pe_lib._demo_positions(pe, n)
        positions = None if positions is None else positions.to(device)
        if pe.kind == "input":
            calls[f"{name} (forward_input + SDPA)"] = \
                lambda q, k, v, x, pe=pe, p=positions: (pe.forward_input(x, p), sdpa(q, k, v, is_causal=True))
            continue
        causal = positions is None or pe.is_causal
        calls[name] = lambda q, k, v, x, pe=pe, p=positions, c=causal: pe_lib.attention(
            q, k, v, pe, positions_q=p, positions_k=p, causal=c)
        if pe.kind == "bias":
            calls[f"{name}, FlexAttention (use_flex=True)"] = lambda q, k, v, x, pe=pe, p=positions, c=causal: \
                pe_lib.attention(q, k, v, pe, positions_q=p, positions_k=p, causal=c, use_flex=True)
    if not ONLY:   # --only times the named entries against the floor, no peers
        calls.update(_peer_attentions(q, k, v, x, h, d, n))
    working = {}
    for name, fn in calls.items():  # a peer built for the CPU may not run on the GPU: leave it out, say so
        try:
            fn(q, k, v, x)
            working[name] = fn
        except Exception as error:  # noqa: BLE001
            print(f"  left out {name}: {type(error).__name__}: {str(error).splitlines()[0][:100]}")

    def total(out):
        return sum(t.float().sum() for t in (out if isinstance(out, tuple) else (out,)))

    def synced(fn):
        def call():
            fn()
            torch.cuda.synchronize()
        return call

    def training(fn):
        def step():
            total(fn(q, k, v, x)).backward()
            for t in (q, k, v, x):
                t.grad = None
        return synced(step)

    def gpu_peak(fn) -> int:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - base

    print(f"\n{torch.cuda.get_device_name()}")
    with torch.no_grad():
        forward = {name: synced(lambda fn=fn: fn(q, k, v, x)) for name, fn in working.items()}
        times = medians(forward, max(3, reps // 3))
        memory = {name: gpu_peak(fn) for name, fn in forward.items()}
    report(f"GPU, every encoding: attention forward, B={b}, H={h}, N={n}, Dh={d} fp32 (ratio to plain SDPA)",
           times, next(iter(times)), memory)
    train = {name: training(fn) for name, fn in working.items()}
    times = medians(train, max(3, reps // 3))
    memory = {name: gpu_peak(fn) for name, fn in train.items()}
    report(f"GPU, every encoding: attention forward + backward, B={b}, H={h}, N={n}, Dh={d} fp32",
           times, next(iter(times)), memory)
    del q, k, v, x
    for b, n in ((2, 4096), (1, 16384), (1, 65536)):   # issue 42's table: bf16, H=16, Dh=128
        _flex_rows(device, torch.bfloat16, b, 16, n, 128, max(3, reps // 10))
        torch.cuda.empty_cache()
    _gpu_rope_rows(reps)


def _flex_rows(device, dtype, b: int, h: int, n: int, d: int, reps: int) -> None:
    """Bias kinds on FlexAttention against what a user writes from attention-gym (``torch.compile(flex_attention)``,
    a causal BlockMask built once, a score_mod reading a per-distance table or a slope): forward and forward +
    backward (the T5 table learned, with its gradient and one pipeline stage, as attention() runs it), median
    time, ratio to SDPA causal, peak extra memory, first-call time (compilation included) and the largest
    difference from attention()'s output. ``device`` "cpu" runs the forward alone, unfused (a smoke test)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cuda = device.type == "cuda"
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flex = torch.compile(flex_attention) if cuda else flex_attention
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(3))
    t5 = pe_lib.T5PositionalEmbedding(h, bidirectional=False).to(device)
    alibi = pe_lib.ALiBiPositionalEmbedding(h).to(device)
    with torch.no_grad():
        t5.relative_attention_bias.weight.normal_()
    causal = create_block_mask(lambda b_, h_, i, j: j <= i, None, None, n, n, device=device)
    table = t5.relative_attention_bias.weight.detach().clone().requires_grad_()          # [buckets, H], learned
    bucket = t5.bucket_of_distance[(-torch.arange(n, device=device)).clamp(-t5.max_distance - 1) + t5.max_distance + 1]
    slopes = alibi.slopes
    options = {"num_stages": 1} if cuda else None

    def t5_by_hand(q, k, v):
        per_distance = table[bucket].T.float()                                          # [H, N]: bias at q - kv
        return flex(q, k, v, score_mod=lambda s, b_, h_, i, j: s + per_distance[h_, i - j], block_mask=causal,
                    kernel_options=options if torch.is_grad_enabled() else None)

    rows = {"SDPA causal (floor)": lambda q, k, v: sdpa(q, k, v, is_causal=True),
            "T5 attention(), defaults": lambda q, k, v: pe_lib.attention(q, k, v, t5),
            "T5 attention() in torch.compile": torch.compile(lambda q, k, v: pe_lib.attention(q, k, v, t5)),
            "T5 hand-written flex (table lookup)": t5_by_hand,
            "ALiBi attention(), defaults": lambda q, k, v: pe_lib.attention(q, k, v, alibi),
            "ALiBi attention() in torch.compile": torch.compile(lambda q, k, v: pe_lib.attention(q, k, v, alibi)),
            "ALiBi hand-written flex (slope)": lambda q, k, v: flex(
                q, k, v, score_mod=lambda s, b_, h_, i, j: s - slopes[h_] * (i - j), block_mask=causal)}
    if not cuda:   # the smoke test: nothing compiled
        rows = {name: fn for name, fn in rows.items() if "torch.compile" not in name}
    reference = {"T5": lambda: pe_lib.attention(q, k, v, t5), "ALiBi": lambda: pe_lib.attention(q, k, v, alibi)}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def peak(fn) -> int:
        if not cuda:
            return peak_memory(fn)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - base

    for mode in ("forward", "forward + backward") if cuda else ("forward",):
        inputs = (q, k, v) if mode == "forward" else tuple(t.detach().requires_grad_() for t in (q, k, v))
        grad_out = torch.randn_like(q)
        calls, first, diffs = {}, {}, {}
        for name, fn in rows.items():
            def call(fn=fn):
                if mode == "forward":
                    with torch.no_grad():
                        out = fn(*inputs)
                else:
                    out = fn(*inputs)
                    out.backward(grad_out)
                sync()
                return out
            try:
                start = time.perf_counter()
                out = call()
                first[name] = time.perf_counter() - start
                family = name.split()[0]
                if family in reference and "hand-written" in name and mode == "forward":
                    with torch.no_grad():
                        diffs[name] = (out.float() - reference[family]().float()).abs().max().item()
                calls[name] = call
            except Exception as error:  # noqa: BLE001 (a row that fails is reported, the others still run)
                print(f"  {mode}, {name}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
        times = medians(calls, reps, warmup=1)
        memory = {name: peak(fn) for name, fn in calls.items()}
        report(f"{device.type}, bias kinds against hand-written FlexAttention: {mode}, B={b}, H={h}, N={n}, Dh={d} "
               f"{str(dtype).replace('torch.', '')}, causal", times, next(iter(times)), memory)
        print("  first call (s): " + ", ".join(f"{name} {t:.1f}" for name, t in first.items()))
        if diffs:
            print("  max |hand-written - attention()|: " + ", ".join(f"{name} {x:.1e}" for name, x in diffs.items()))


def _gpu_rope_rows(reps: int) -> None:
    """Issue 42's RoPE rows on the GPU: plain SDPA, RoPE through attention() (the library's compiled rotation)
    and the HF-style rotation + SDPA, bf16, causal, H=16, Dh=128, at N = 4096 (B=2), 16384 and 65536 (B=1):
    forward (no grad) and forward + backward, each with its peak extra memory and its first call's time
    (compilation included). A row that fails prints its error."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    h, d, dtype = 16, 128, torch.bfloat16
    rope = pe_lib.RotaryPositionalEmbedding(d).cuda()
    for b, n in ((2, 4096), (1, 16384), (1, 65536)):
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
        cos, sin = hf_rope_tables(n, d, dtype, device="cuda")
        rows = {"SDPA causal (floor)": lambda q, k, v: sdpa(q, k, v, is_causal=True),
                "RoPE attention()": lambda q, k, v: pe_lib.attention(q, k, v, rope, causal=True),
                "HF-style rotate_half + SDPA": lambda q, k, v: sdpa(hf_rope(q, cos, sin), hf_rope(k, cos, sin), v,
                                                                    is_causal=True)}
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        grad = torch.randn_like(q)
        modes = {"forward": lambda fn: fn(q, k, v), "forward + backward": lambda fn: fn(*leaves).backward(grad)}
        for mode, run in modes.items():
            print(f"\nGPU RoPE, {mode}, B={b}, H={h}, N={n}, Dh={d} bf16, causal ({torch.cuda.get_device_name()})")
            print(f"  {'implementation':<36}{'median ms':>10}{'ratio':>8}{'peak MiB':>10}{'first s':>9}")
            floor = None
            for name, fn in rows.items():
                def call(fn=fn):
                    with torch.set_grad_enabled(mode != "forward"):
                        run(fn)
                    for t in leaves:
                        t.grad = None
                    torch.cuda.synchronize()
                try:
                    start = time.perf_counter()
                    call()
                    first = time.perf_counter() - start
                    seconds = medians({name: call}, max(3, reps // 3))[name]
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    call()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                except Exception as error:  # noqa: BLE001  (out of memory, a failed compile: say so, go on)
                    print(f"  {name:<36}ERROR {type(error).__name__}: {str(error).strip()[:120]}")
                    torch.cuda.empty_cache()
                    continue
                floor = seconds if floor is None else floor
                print(f"  {name:<36}{seconds * 1e3:>10.3f}{seconds / floor:>8.2f}{peak:>10.0f}{first:>9.1f}")
        del q, k, v, leaves, grad
        torch.cuda.empty_cache()
    state = pe_lib._FUSED_ROTATION
    print(f"  (the library's compiled rotation: {len(state.get('kinds', ()))} kinds of call compiled"
          + (f"; it failed: {state['error']!r}" if "error" in state else "") + ")")


SECTIONS = {"all": bench_all, "rope": bench_rope, "rope_attention": bench_rope_attention,
            "rope_precision": bench_rope_precision, "t5": bench_t5,
            "heinsen": bench_heinsen, "heinsen_precision": bench_heinsen_precision, "algebraic": bench_algebraic,
            "gqa": bench_gqa, "bias_paths": bench_bias_paths, "gpu": bench_gpu}


REGIMES = {
    "fresh pages": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "reused memory": {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**34),
                      "MALLOC_TOP_PAD_": str(2**28)},
}


def parse_args(argv: list) -> argparse.Namespace:
    # allow_abbrev=False: "--reg" would otherwise mean --regime and escape child_argv's filter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("sections", nargs="*", choices=[[], *SECTIONS], default=[], help="default: all")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per implementation")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile figures")
    parser.add_argument("--regime", choices=[*REGIMES, "both"], default="both",
                        help="allocator regime (default: both, each in a child process)")
    parser.add_argument("--only", default=None,
                        help="all / gpu: only these demo entries (comma-separated), besides the floor")
    return parser.parse_args(argv)


def child_argv(argv: list, regime: str) -> list:
    """``argv`` with every ``--regime X`` / ``--regime=X`` replaced by one ``--regime <regime>``."""
    kept, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg == "--regime":
            skip_value = True   # its value is the next word ("both"), not a section
        elif not arg.startswith("--regime="):
            kept.append(arg)
    return [*kept, "--regime", regime]


def main(argv: list = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.regime == "both":
        for regime, env in REGIMES.items():
            subprocess.run([sys.executable, os.path.abspath(__file__), *child_argv(argv, regime)],
                           env={**os.environ, **env}, check=True)
        return
    print(f"\n===== allocator: {args.regime} ({' '.join(f'{k}={v}' for k, v in REGIMES[args.regime].items())}) =====")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    if args.only is not None:
        ONLY.update(args.only.split(","))
        unknown = ONLY - set(pe_lib._demo_modules(4, 8, 16))
        if unknown:
            raise SystemExit(f"--only: no demo entry named {', '.join(sorted(unknown))}")
    for name in args.sections or SECTIONS:
        SECTIONS[name](args.reps, compile=not args.no_compile)


if __name__ == "__main__":
    main()
