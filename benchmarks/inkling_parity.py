"""Max |ours - reference| of InklingPositionalEmbedding against x-transformers' RelativeProjPositionalBias and the
transformers 5.24 Inkling modules (InklingAttention's position_bias, Inkling2RelativePositionBias), same weights.

    python benchmarks/inkling_parity.py      # needs transformers 5.24 and x-transformers
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import positional_embeddings as pe_lib  # noqa: E402
from x_transformers.x_transformers import RelativeProjPositionalBias
from transformers.models.inkling import modeling_inkling as m1, configuration_inkling as c1
from transformers.models.inkling2 import modeling_inkling2 as m2, configuration_inkling2 as c2
torch.manual_seed(0)
B, N, D, H = 2, 300, 64, 4
x = torch.randn(B, N, D)
theirs = RelativeProjPositionalBias(D, H, num_distance_basis=16, max_dist=128)
with torch.no_grad(): theirs.distance_bank.normal_()
ours = pe_lib.InklingPositionalEmbedding(D, H, d_rel=16, max_distance=128, bias=True)
with torch.no_grad():
    ours.r_proj.weight.copy_(theirs.to_distance_weights[0].weight); ours.r_proj.bias.copy_(theirs.to_distance_weights[0].bias); ours.proj.copy_(theirs.distance_bank)
print("x-transformers", (ours(x)(N, N) - theirs(x)).abs().max().item())
kw = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=1, head_dim=16, swa_num_attention_heads=H, swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=64, d_rel=16, rel_extent=128, num_hidden_layers=2, intermediate_size=128, vocab_size=64, log_scaling_n_floor=32, log_scaling_alpha=0.1)
cfg = c1.InklingTextConfig(layer_types=["hybrid", "hybrid_sliding"], **kw); cfg._attn_implementation = "eager"
seen = {}; orig = m1.eager_attention_forward
def spy(module, q, k, v, mask, scaling, dropout=0.0, position_bias=None, **kw2):
    seen["b"] = position_bias; return orig(module, q, k, v, mask, scaling, dropout, position_bias, **kw2)
m1.eager_attention_forward = spy
for layer, floor in ((0, 32), (1, None)):
    att = m1.InklingAttention(cfg, layer)
    for p in att.parameters(): torch.nn.init.normal_(p, std=0.3)
    o = pe_lib.InklingPositionalEmbedding(D, H, d_rel=16, max_distance=att.rel_extent, log_scaling_n_floor=floor, log_scaling_alpha=0.1)
    with torch.no_grad():
        o.r_proj.weight.copy_(att.r_proj.weight); o.proj.copy_(att.rel_logits_proj.proj); att(x, attention_mask=None)
    print("InklingAttention", "full" if floor else "sliding", (o(x)(N, N) - seen["b"]).abs().max().item(), "| bias scale", seen["b"].abs().max().item())
cfg2 = c2.Inkling2TextConfig(rel_l2_clip_threshold=8.0, **kw)
for log_scaling in (False, True):
    rpb = m2.Inkling2RelativePositionBias(cfg2, H, 128, log_scaling=log_scaling)
    for p in rpb.parameters(): torch.nn.init.normal_(p, std=0.3)
    o = pe_lib.InklingPositionalEmbedding(D, H, d_rel=16, max_distance=128, clip_threshold=8.0, log_scaling_n_floor=32 if log_scaling else None, log_scaling_alpha=0.1)
    with torch.no_grad():
        o.r_proj.weight.copy_(rpb.linear.weight); o.scale.copy_(rpb.norm.scale); o.proj.copy_(rpb.proj)
    t = torch.arange(N)
    want = rpb(x, t[:, None] - t[None, :], t.expand(B, N))
    print("Inkling2RelativePositionBias", "log_scaling" if log_scaling else "plain", (o(x)(N, N) - want).abs().max().item(), "| bias scale", want.abs().max().item())
