"""Scaling out: sequence shards over 2 processes (gloo on CPU) equal the single-process run.

One spawn of 2 ranks runs every distributed check (every class of ``CASES`` on a sequence
shard, Heinsen's sharded scan at a million tokens, PyTorch's context parallel) and each rank
saves its measured errors; the tests below read them. A second spawn checks data parallelism:
DDP and FSDP2 (``fully_shard``, deferred meta init) against one process, one case per class. Runs as ``drafts/test_scale_out.py``
(imports the draft section) or as a top-level ``test_distributed.py`` once the section is in
``positional_embeddings.py``.
"""

import copy
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

import positional_embeddings as pe_lib
from positional_embeddings import (
    HeinsenPositionalEmbedding,
    RotaryPositionalEmbedding,
    _LogLinearScanFunction,
    attention,
)
from test_positional_embeddings import CASES, B, H, N, DH


def _shardable(case) -> bool:
    """Classes whose shard needs only global positions (or, for Heinsen, the summary exchange).
    Left out: content-ordered ones (CoPE counts gates, the forget gate is bound to token states) and
    the convolutional encoding, whose shard would need its neighbours' tokens (a halo exchange)."""
    pe = case.make()
    return pe.takes_positions and (case.takes_positions or isinstance(pe, pe_lib.HeinsenPositionalEmbedding))


SHARDED_CASES = [case for case in CASES if _shardable(case)]

from positional_embeddings import heinsen_forward_sharded, shard_positions, sharded_log_linear_scan

dist = torch.distributed
WORLD = 2
SPAWN_TIMEOUT_S = 150     # the whole spawn; a hung collective fails the tests instead of hanging them
SCAN_TOKENS = 1_000_000
HAS_GLOO = dist.is_available() and dist.is_gloo_available()
needs_gloo = pytest.mark.skipif(not HAS_GLOO, reason="torch.distributed or its gloo backend is not available")


# ---------------------------------------------------------------------------
# shard_positions (no process group needed)
# ---------------------------------------------------------------------------


class TestShardPositions:
    @pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
    @pytest.mark.parametrize("world", [1, 2, 3, 4])
    def test_shards_partition_the_sequence(self, layout, world):
        n = 24
        shards = [shard_positions(n, r, world, layout=layout) for r in range(world)]
        assert torch.equal(torch.cat(shards).sort().values, torch.arange(n))
        assert all(s.dtype == torch.long for s in shards)
        if layout == "contiguous":  # rank order is sequence order
            assert torch.equal(torch.cat(shards), torch.arange(n))

    def test_uneven_contiguous_split_is_tensor_split(self):
        for r, want in enumerate(torch.arange(10).tensor_split(4)):
            assert torch.equal(shard_positions(10, r, 4), want)

    def test_head_tail_pairs_chunk_r_with_its_mirror(self):
        # 16 tokens, 2 ranks: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        assert shard_positions(16, 0, 2, layout="head_tail").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
        assert shard_positions(16, 1, 2, layout="head_tail").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]

    def test_matches_context_parallel_load_balancer(self):
        balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
        order = balancer._HeadTailLoadBalancer(24, 3, "cpu")._generate_indices()[0].long()   # [N], rank-major
        mine = torch.cat([shard_positions(24, r, 3, layout="head_tail") for r in range(3)])
        assert torch.equal(mine, order)

    def test_offset_and_numpy_like_ints(self):
        class Index:
            def __index__(self):
                return 2
        assert torch.equal(shard_positions(8, 1, Index(), offset=100), torch.arange(104, 108))

    def test_bad_input(self):
        with pytest.raises(ValueError, match="shard_positions: rank must lie in \\[0, world_size=2\\), got rank=2"):
            shard_positions(8, 2, 2)
        with pytest.raises(ValueError, match="shard_positions: world_size must be a positive int"):
            shard_positions(8, 0, 0)
        with pytest.raises(ValueError, match="shard_positions: seq_len must be >= 0, got seq_len=-1"):
            shard_positions(-1, 0, 2)
        with pytest.raises(TypeError, match="shard_positions: seq_len must be an int, got float 8.0"):
            shard_positions(8.0, 0, 2)
        with pytest.raises(TypeError, match="shard_positions: rank must be an int, got True"):
            shard_positions(8, True, 2)
        with pytest.raises(ValueError, match="shard_positions: layout='head_tail' needs seq_len divisible by"):
            shard_positions(6, 0, 2, layout="head_tail")
        with pytest.raises(ValueError, match="shard_positions: layout must be 'contiguous' or 'head_tail'"):
            shard_positions(8, 0, 2, layout="zigzag")

    def test_scan_without_process_group_says_so(self):
        if HAS_GLOO and dist.is_initialized():
            pytest.skip("a process group is initialised in this process")
        with pytest.raises(ValueError, match="sharded_log_linear_scan: needs an initialised torch.distributed"):
            sharded_log_linear_scan(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))
        with pytest.raises(ValueError, match="sharded_log_linear_scan: log_p and h must have the same shape"):
            sharded_log_linear_scan(torch.zeros(1, 4, 2), torch.zeros(1, 5, 2))
        with pytest.raises(TypeError, match="heinsen_forward_sharded: module must be a HeinsenPositionalEmbedding"):
            heinsen_forward_sharded(RotaryPositionalEmbedding(8), torch.zeros(1, 4, 8))


# ---------------------------------------------------------------------------
# The checks each rank runs (module level, so the spawned processes can import them)
# ---------------------------------------------------------------------------


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want| over finite entries; inf unless both hold -inf/inf at the same places."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape or not torch.equal(torch.isinf(got), torch.isinf(want)) \
            or torch.isnan(got).any() or torch.isnan(want).any():
        return float("inf")
    finite = torch.isfinite(want)
    return (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0


def _gather_rows(local: torch.Tensor, idx: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """The full tensor from every rank's rows ``local`` at global indices ``idx`` along ``dim`` (shards may differ in size)."""
    dim = dim % local.dim()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(WORLD)]
    dist.all_gather(sizes, torch.tensor([idx.numel()]))
    most = max(int(n) for n in sizes)
    pad = [0, 0] * (local.dim() - 1 - dim) + [0, most - idx.numel()]
    parts = [torch.empty_like(F.pad(local.detach(), pad)) for _ in range(WORLD)]
    indices = [torch.empty(most, dtype=torch.long, device=idx.device) for _ in range(WORLD)]
    dist.all_gather(parts, F.pad(local.detach(), pad).contiguous())
    dist.all_gather(indices, F.pad(idx, (0, most - idx.numel())))
    shape = list(local.shape)
    shape[dim] = length
    full = local.new_empty(shape)
    for part, index, n in zip(parts, indices, sizes):
        full.index_copy_(dim, index[: int(n)], part.narrow(dim, 0, int(n)))
    return full


def _summed_grads(module: torch.nn.Module) -> list:
    """This rank's parameter gradients summed over ranks (what DDP's all-reduce gives)."""
    grads = []
    for p in module.parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        grads.append(g)
    return grads


def _grad_error(got: list, module: torch.nn.Module) -> float:
    """Max |got - want| / max(1, max |want|) over the parameters: each parameter's gradient is a sum over
    all tokens, which the ranks add in another order (float32 sums of gradients of size ~100 differ by ~1e-4)."""
    errors = []
    for g, p in zip(got, module.parameters()):
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        errors.append(_max_error(g, want) / max(1.0, want.abs().max().item() if want.numel() else 0.0))
    return max(errors, default=0.0)


def _check_case(case, layout: str, rank: int) -> dict:
    """One class on a sequence shard against the same class on the whole sequence."""
    torch.manual_seed(0)  # the same module and data on every rank
    full_pe = case.make()
    pe = copy.deepcopy(full_pe)
    x = torch.randn(B, N, case.token_dim)
    q, k, v, weight = torch.randn(4, B, H, N, DH).unbind(0)
    weight_x = torch.randn(B, N, case.token_dim)
    idx = shard_positions(N, rank, WORLD, layout=layout)                               # [N_local] global indices
    positions = None if case.required_positions is None else case.required_positions(N)
    positions_q = idx if positions is None else positions[idx]                         # the shard's global positions
    positions_k = torch.arange(N) if positions is None else positions                  # every key's position
    errors = {}
    if full_pe.kind == "input":
        x_full = x.clone().requires_grad_(True)
        want = full_pe.forward_input(x_full, positions) if case.takes_positions else full_pe(x_full)
        (want * weight_x).sum().backward()
        x_local = x[:, idx].clone().requires_grad_(True)
        if case.takes_positions:
            got = pe.forward_input(x_local, positions_q)
        else:  # Heinsen: the order is the recurrence; the ranks exchange state summaries
            got = heinsen_forward_sharded(pe, x_local)
        (got * weight_x[:, idx]).sum().backward()
        errors["output"] = _max_error(_gather_rows(got, idx, -2, N), want)
        errors["grad_x"] = _max_error(_gather_rows(x_local.grad, idx, -2, N), x_full.grad)
    else:
        q_full = q.clone().requires_grad_(True)
        want_logits = full_pe.forward_attn(q_full, k, positions, positions)
        want = attention(q_full, k, v, full_pe, positions_q=positions, positions_k=positions, causal=True)
        (want * weight).sum().backward()
        # each rank holds its q, k, v shard; the keys and values are all-gathered (ring attention's
        # result, without the ring), the queries stay local with their global positions
        keys = _gather_rows(k[:, :, idx], idx, -2, N)
        values = _gather_rows(v[:, :, idx], idx, -2, N)
        causal = idx[:, None] >= torch.arange(N)[None, :]                               # [N_local, N] by global index
        q_local = q[:, :, idx].clone().requires_grad_(True)
        got_logits = pe.forward_attn(q_local, keys, positions_q, positions_k)
        got = attention(q_local, keys, values, pe, positions_q=positions_q, positions_k=positions_k, attn_mask=causal)
        (got * weight[:, :, idx]).sum().backward()
        errors["logits"] = _max_error(_gather_rows(got_logits, idx, -2, N), want_logits)
        errors["output"] = _max_error(_gather_rows(got, idx, -2, N), want)
        errors["grad_q"] = _max_error(_gather_rows(q_local.grad, idx, -2, N), q_full.grad)
    errors["grad_params_rel"] = _grad_error(_summed_grads(pe), full_pe)
    return errors


def _check_heinsen_scan(rank: int) -> dict:
    """sharded_log_linear_scan at a million tokens (float64) against the single-process scan."""
    n, d = SCAN_TOKENS, 4
    g = torch.Generator().manual_seed(1)
    # decays from strong (sigmoid(N(0, 1))) to very weak (sigmoid(14 + N(0, 1)), log_p ~ -1e-6):
    # rank 0's state still weighs on rank 1's last tokens
    z = torch.randn(1, n, d, generator=g, dtype=torch.float64) + torch.tensor([0.0, 4.0, 8.0, 14.0], dtype=torch.float64)
    h, weight = torch.randn(2, 1, n, d, generator=g, dtype=torch.float64).unbind(0)
    initial, weight_final = torch.randn(2, 1, 1, d, generator=g, dtype=torch.float64).unbind(0)
    idx = shard_positions(n, rank, WORLD)
    mine = [z[:, idx].clone().requires_grad_(True), h[:, idx].clone().requires_grad_(True),
            initial.clone().requires_grad_(True)]
    start = time.perf_counter()
    s_local, final = sharded_log_linear_scan(F.logsigmoid(mine[0]), mine[1], mine[2], return_state=True)
    # the final state is the same on every rank: count it once (rank 0, whose graph reaches rank 1's tokens)
    loss = (s_local * weight[:, idx]).sum() + ((final * weight_final).sum() if rank == 0 else 0.0)
    loss.backward()
    seconds = time.perf_counter() - start
    grad_initial = mine[2].grad.clone()
    dist.all_reduce(grad_initial)
    gathered = [_gather_rows(t, idx, -2, n) for t in (s_local, mine[0].grad, mine[1].grad)]
    if rank:  # the single-process run is done once, on rank 0 (the machine may have 2 cores)
        return {"seconds": seconds}
    leaves = [t.clone().requires_grad_(True) for t in (z, h, initial)]
    s = _LogLinearScanFunction.apply(F.logsigmoid(leaves[0]), leaves[1], leaves[2])    # [1, n, d]
    ((s * weight).sum() + (s[:, -1:] * weight_final).sum()).backward()
    return {
        "s": _max_error(gathered[0], s),
        "final": _max_error(final, s[:, -1:]),
        "grad_log_p": _max_error(gathered[1], leaves[0].grad),
        "grad_h": _max_error(gathered[2], leaves[1].grad),
        "grad_initial": _max_error(grad_initial, leaves[2].grad),
        "seconds": seconds,
    }


def _check_scan_oracle(rank: int) -> dict:
    """The sharded scan against a plain float64 loop of the recurrence, uneven shards (101 + 100)."""
    g = torch.Generator().manual_seed(2)
    n, d = 201, 3
    log_p = F.logsigmoid(torch.randn(2, n, d, generator=g, dtype=torch.float64) * 3 + 2)
    h = torch.randn(2, n, d, generator=g, dtype=torch.float64) * 3
    want = torch.empty_like(h)
    state = torch.zeros(2, d, dtype=torch.float64)
    for t in range(n):
        for b in range(2):
            for c in range(d):
                state[b, c] = torch.logaddexp(log_p[b, t, c] + state[b, c], h[b, t, c])
        want[:, t] = state
    idx = shard_positions(n, rank, WORLD)
    got = sharded_log_linear_scan(log_p[:, idx], h[:, idx])
    got32 = sharded_log_linear_scan(log_p[:, idx].float(), h[:, idx].float())
    return {"float64": _max_error(_gather_rows(got, idx, -2, n), want),
            "float32": _max_error(_gather_rows(got32, idx, -2, n), want)}


def _check_empty_shard(rank: int) -> dict:
    """A rank with no tokens passes the state on, forward and backward."""
    g = torch.Generator().manual_seed(3)
    log_p = F.logsigmoid(torch.randn(1, 9, 2, generator=g, dtype=torch.float64)).requires_grad_(True)
    h = torch.randn(1, 9, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    s = _LogLinearScanFunction.apply(log_p, h, torch.zeros(1, 1, 2, dtype=torch.float64))
    s.sum().backward()
    idx = torch.arange(9) if rank == 1 else torch.arange(0)                            # rank 0 holds nothing
    mine = [log_p.detach()[:, idx].requires_grad_(True), h.detach()[:, idx].requires_grad_(True)]
    s_local = sharded_log_linear_scan(*mine)
    s_local.sum().backward()
    return {"s": _max_error(s_local, s[:, idx]), "grad_h": _max_error(mine[1].grad, h.grad[:, idx])}


def _check_heinsen_module(rank: int) -> dict:
    """heinsen_forward_sharded on 2**17 tokens, then a second sharded chunk continuing the stream."""
    torch.manual_seed(4)
    full_pe = HeinsenPositionalEmbedding(8, 4).double()
    pe = copy.deepcopy(full_pe)
    n = 2 ** 17
    x, weight = torch.randn(2, 1, n, 8, dtype=torch.float64).unbind(0)
    x2, weight2 = torch.randn(2, 1, 64, 8, dtype=torch.float64).unbind(0)
    x_full = x.clone().requires_grad_(True)
    y = full_pe(x_full)
    y2 = full_pe(x2, using_prev_context=True)   # detached context: truncated backprop, as the reference
    ((y * weight).sum() + (y2 * weight2).sum()).backward()
    idx, idx2 = shard_positions(n, rank, WORLD), shard_positions(64, rank, WORLD)
    x_local = x[:, idx].clone().requires_grad_(True)
    got = heinsen_forward_sharded(pe, x_local)
    got2 = heinsen_forward_sharded(pe, x2[:, idx2], using_prev_context=True)
    ((got * weight[:, idx]).sum() + (got2 * weight2[:, idx2]).sum()).backward()
    return {
        "output": _max_error(_gather_rows(got, idx, -2, n), y),
        "continued_chunk": _max_error(_gather_rows(got2, idx2, -2, 64), y2),
        "cached_context": _max_error(pe.prev_context, full_pe.prev_context),
        "grad_x": _max_error(_gather_rows(x_local.grad, idx, -2, n), x_full.grad),
        "grad_params_rel": _grad_error(_summed_grads(pe), full_pe),
    }


def _check_context_parallel(rank: int, device: str = "cpu") -> dict:
    """RoPE with each shard's global positions inside PyTorch's context_parallel (ring SDPA)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    torch.manual_seed(5)
    n = 64
    q, k, v = torch.randn(3, 1, H, n, DH, device=device).unbind(0)
    rope = RotaryPositionalEmbedding(DH).to(device)
    want = attention(q, k, v, rope, causal=True)
    mesh = init_device_mesh(device, (WORLD,))
    buffers = [q.clone(), k.clone(), v.clone()]
    idx = shard_positions(n, rank, WORLD, layout="head_tail", device=device)   # the order context_parallel uses
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            layout_ok = torch.equal(buffers[0], q[:, :, idx])
            # attention() runs F.scaled_dot_product_attention(is_causal=True), which the context patches
            out = attention(*buffers, rope, positions_q=idx, positions_k=idx, causal=True)
    except Exception as error:  # noqa: BLE001 - the message is the finding (CPU has no ring kernel)
        return {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
    return {"output": _max_error(_gather_rows(out, idx, -2, n), want), "layout_is_head_tail": float(layout_ok)}


def _checks() -> list:
    checks = [(f"case/{case.name}/{layout}", lambda rank, case=case, layout=layout: _check_case(case, layout, rank))
              for case in SHARDED_CASES for layout in ("contiguous", "head_tail")
              if case.takes_positions or layout == "contiguous"]
    return checks + [("heinsen_scan_1e6", _check_heinsen_scan), ("scan_oracle", _check_scan_oracle),
                     ("empty_shard", _check_empty_shard), ("heinsen_module", _check_heinsen_module),
                     ("context_parallel_cpu", _check_context_parallel)]


def _worker(rank: int, port: int, out_dir: str, backend: str, names: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    results = {}
    for name, check in _checks() + _data_parallel_checks():
        if name not in names:
            continue
        try:
            results[name] = _check_context_parallel(rank, "cuda") if "nccl" in backend else check(rank)
        except Exception:  # noqa: BLE001 - reported by the test that reads it
            results[name] = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(names: list, backend: str = "gloo") -> dict:
    """Spawn WORLD ranks running the named checks; {name: {metric: worst value over ranks}}."""
    context = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        ranks = [context.Process(target=_worker, args=(r, port, out_dir, backend, names)) for r in range(WORLD)]
        for p in ranks:
            p.start()
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        for p in ranks:
            p.join(max(deadline - time.monotonic(), 0))
        hung = [p.pid for p in ranks if p.is_alive()]
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise RuntimeError(f"distributed checks exceeded {SPAWN_TIMEOUT_S} s (ranks {hung} killed)")
        per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]
    merged = {}
    for name in per_rank[0]:
        merged[name] = {}
        for result in per_rank:
            for metric, value in result[name].items():
                if isinstance(value, str):
                    merged[name][metric] = value
                elif not isinstance(merged[name].get(metric), str):
                    merged[name][metric] = max(value, merged[name].get(metric, value))
    return merged


@pytest.fixture(scope="module")
def results():
    if not HAS_GLOO:
        pytest.skip("torch.distributed or its gloo backend is not available")
    return run_distributed([name for name, _ in _checks()])


def _measured(results, name) -> dict:
    found = results[name]
    assert "error" not in found, found.get("error")
    return found


# float32 compute at N=16: rounding differences between one dense call and shards (outputs,
# logits, input gradients); parameter gradients are sums over every token that the ranks add
# in another order, compared relative to their size
CASE_TOL, GRAD_TOL = 2e-5, 1e-4


@needs_gloo
@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("case", SHARDED_CASES, ids=repr)
def test_shards_equal_single_process(results, case, layout):
    if not case.takes_positions and layout != "contiguous":
        pytest.skip("a recurrence needs its shards in sequence order")
    for metric, error in _measured(results, f"case/{case.name}/{layout}").items():
        assert error <= (GRAD_TOL if metric == "grad_params_rel" else CASE_TOL), f"{case.name} ({layout}): {metric} differs by {error:.2e}"


@needs_gloo
def test_heinsen_scan_million_tokens_forward_and_backward(results):
    found = _measured(results, "heinsen_scan_1e6")
    for metric in ("s", "final", "grad_log_p", "grad_h", "grad_initial"):
        assert found[metric] <= 1e-6, f"{metric} differs by {found[metric]:.2e}"


@needs_gloo
def test_sharded_scan_matches_float64_loop_oracle(results):
    found = _measured(results, "scan_oracle")
    assert found["float64"] <= 1e-12 and found["float32"] <= 5e-6, found


@needs_gloo
def test_empty_shard_passes_the_state_on(results):
    found = _measured(results, "empty_shard")
    assert found["s"] <= 1e-12 and found["grad_h"] <= 1e-12, found


@needs_gloo
def test_heinsen_module_sharded_forward_backward_and_streaming(results):
    for metric, error in _measured(results, "heinsen_module").items():
        assert error <= 1e-9, f"{metric} differs by {error:.2e}"


@needs_gloo
def test_context_parallel_rope_cpu(results):
    found = results["context_parallel_cpu"]
    if "error" in found:
        # torch 2.13: context_parallel routes SDPA to ring kernels for the flash / efficient /
        # cuDNN CUDA ops only; CPU SDPA (aten._scaled_dot_product_flash_attention_for_cpu) has no
        # DTensor sharding strategy.
        pytest.skip(f"context_parallel does not run on CPU in torch {torch.__version__}: {found['error']}")
    assert found["layout_is_head_tail"] == 1.0
    assert found["output"] <= 1e-5, found


@pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= WORLD),
                    reason=f"context_parallel's ring SDPA needs CUDA: {WORLD} GPUs and NCCL")
def test_context_parallel_rope_cuda():
    found = run_distributed(["context_parallel_cpu"], backend="cpu:gloo,cuda:nccl")["context_parallel_cpu"]
    assert "error" not in found, found["error"]
    assert found["layout_is_head_tail"] == 1.0
    assert found["output"] <= 1e-3, found   # flash / efficient kernels round in their own order


# ---------------------------------------------------------------------------
# Data parallel: DDP and FSDP2 (fully_shard, deferred meta init) equal the single-process run
# ---------------------------------------------------------------------------


def _one_case_per_class() -> list:
    """The first case of every class that has parameters (the others have nothing to shard or reduce),
    and wav2vec 2.0's weight-normed convolution (its init reads one parameter into another)."""
    seen, cases = set(), []
    for case in CASES:
        pe = case.make()
        if (type(pe) not in seen or case.name == "conv_wav2vec2") and any(True for _ in pe.parameters()):
            seen.add(type(pe))
            cases.append(case)
    return cases


PARALLEL_CASES = _one_case_per_class()
# the classes whose seed-dependent parameters the library itself draws full-size (``_copy_into``), so
# a sharded deferred init keeps them bitwise; nn.init on a CPU DTensor draws each shard from the local
# generator instead (torch's DTensor RNG tracker covers CUDA-like devices only)
FULL_DRAWS = (pe_lib.AlgebraicTreePositionalEmbedding, pe_lib.MixedRotaryPositionalEmbedding)


class _Layer(torch.nn.Module):
    """A tiny attention layer around an encoding: qkv projection, the encoding, attention()."""

    def __init__(self, case) -> None:
        super().__init__()
        self.case = case
        self.qkv = torch.nn.Linear(case.token_dim, 3 * H * DH)
        self.pe = case.make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = None if self.case.required_positions is None else self.case.required_positions(x.shape[-2])
        if self.pe.kind == "input":
            x = self.pe.forward_input(x, positions) if self.case.takes_positions else self.pe(x)
        q, k, v = self.qkv(x).unflatten(-1, (3, H, DH)).permute(2, 0, 3, 1, 4)          # [B, H, N, Dh] each
        return attention(q, k, v, self.pe, positions_q=positions, positions_k=positions, causal=True)


def _reference(model: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """Single-process output and gradients of the loss the ranks' mean gives: sum(out * weight) / WORLD."""
    model = copy.deepcopy(model)
    out = model(x)
    ((out * weight).sum() / WORLD).backward()
    return out.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def _rank_errors(model: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, rank: int, want: tuple) -> dict:
    """This rank's half of the batch through ``model`` (DDP or FSDP2) against the reference."""
    rows = slice(rank, rank + 1)
    out = model(x[rows])
    (out * weight[rows]).sum().backward()
    trained = [p for p in model.parameters() if p.requires_grad]                       # FIRE's init_L is frozen
    grads = [pe_lib._full(p.grad) if p.grad is not None else torch.zeros(p.shape) for p in trained]
    want_out, want_grads = want
    return {"output": _max_error(out, want_out[rows]),
            "grad_params_rel": max(_max_error(g, w) / max(1.0, w.abs().max().item()) for g, w in zip(grads, want_grads))}


def _check_data_parallel(case, rank: int) -> dict:
    """DDP, FSDP2 (the encoding and the layer each fully_shard-ed) and FSDP2 with deferred init."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _Layer(case)
    x = torch.randn(WORLD, N, case.token_dim)                                           # the global batch
    weight = torch.randn(WORLD, H, N, DH)
    want = _reference(model, x, weight)
    errors = {}
    ddp = DistributedDataParallel(copy.deepcopy(model))
    errors.update({f"ddp_{m}": e for m, e in _rank_errors(ddp, x, weight, rank, want).items()})
    sharded = copy.deepcopy(model)
    fully_shard(sharded.pe)
    fully_shard(sharded)
    errors.update({f"fsdp_{m}": e for m, e in _rank_errors(sharded, x, weight, rank, want).items()})

    # deferred init: build on meta, shard, allocate, reset; against reset_parameters of a normal module
    with torch.device("meta"):
        deferred = _Layer(case)
    fully_shard(deferred.pe)
    fully_shard(deferred)
    deferred.to_empty(device="cpu")
    deferred.qkv.reset_parameters()
    torch.manual_seed(1)
    deferred.pe.reset_parameters()
    normal, other = case.make(), case.make()
    torch.manual_seed(1)
    normal.reset_parameters()
    torch.manual_seed(2)
    other.reset_parameters()                                                            # tells what depends on the seed
    fixed, drawn = [], []
    for got, same_seed, other_seed in zip(deferred.pe.parameters(), normal.parameters(), other.parameters()):
        (drawn if not torch.equal(same_seed, other_seed) else fixed).append(_max_error(pe_lib._full(got), same_seed))
    fixed += [_max_error(got, same) for got, same in zip(deferred.pe.buffers(), normal.buffers())]
    errors["deferred_init_fixed"] = max(fixed, default=0.0)
    if isinstance(normal, FULL_DRAWS):
        errors["deferred_init_drawn"] = max(drawn, default=0.0)
    # the deferred model against a single process holding its (gathered) weights
    single = _Layer(case)
    with torch.no_grad():
        for p, q in zip(single.parameters(), deferred.parameters()):
            p.copy_(pe_lib._full(q))
    errors.update({f"deferred_{m}": e for m, e in _rank_errors(deferred, x, weight, rank, _reference(single, x, weight)).items()})
    return errors


def _data_parallel_checks() -> list:
    return [(f"data_parallel/{case.name}", lambda rank, case=case: _check_data_parallel(case, rank))
            for case in PARALLEL_CASES]


def _has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return HAS_GLOO


@pytest.fixture(scope="module")
def data_parallel_results():
    if not _has_fully_shard():
        pytest.skip("torch.distributed, gloo or FSDP2's fully_shard is not available")
    return run_distributed([name for name, _ in _data_parallel_checks()])


# float32 at N=16: DDP and FSDP2 average the two ranks' gradients, the reference sums the whole
# batch: the same terms added in another order
PARALLEL_TOL = 1e-5


@needs_gloo
@pytest.mark.parametrize("case", PARALLEL_CASES, ids=repr)
def test_ddp_and_fsdp2_equal_single_process(data_parallel_results, case):
    found = _measured(data_parallel_results, f"data_parallel/{case.name}")
    for metric, error in found.items():
        want = 0.0 if metric.startswith("deferred_init") else PARALLEL_TOL   # init: bitwise
        assert error <= want, f"{case.name}: {metric} differs by {error:.2e}"


if __name__ == "__main__":  # the figures for the README
    for name, found in run_distributed([name for name, _ in _checks()]).items():
        print(f"{name:<48}" + "  ".join(f"{m}={v:.1e}" if not isinstance(v, str) else f"{m}={v}"
                                        for m, v in found.items()))
