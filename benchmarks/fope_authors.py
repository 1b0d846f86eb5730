"""FoPE against the authors' own module, with the same coefficients (a local check, not run by CI).

The authors' code (github TsinghuaC3I/Fourier-Position-Embedding, ``olmo/model.py``, class
``FourierEmbedding``) is an OLMo fork that is not on PyPI, so the tests compare FoPE with a float64
loop of the formula instead, and this script compares it with the authors' module where a copy
of their ``olmo/`` and ``olmo_data/`` folders is on ``PYTHONPATH`` (with omegaconf, rich,
cached_path, datasets and importlib_resources installed beside torch):

    PYTHONPATH=/path/to/Fourier-Position-Embedding python benchmarks/fope_authors.py [N]

It builds their module as their released configs do (head_dim 64, 8 heads, ``eye_xavier_norm``
with gain 0.3, clipped frequencies dropped, ``P = min(D, head_dim // 4)``), copies its coefficients
into ``FoPEPositionalEmbedding(..., num_pairs=P, padded="ones")``, and prints the largest
difference on N positions (default 2L), with our float64 path as the reference for both.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import positional_embeddings as pe_lib  # noqa: E402


def authors_module(train_length: int):
    from olmo.config import ModelConfig
    from olmo.model import BufferCache, FourierEmbedding
    config = ModelConfig(d_model=512, n_heads=8, n_layers=1, max_sequence_length=train_length, rope=True,
                         rope_clamp_floor_freq=True, rope_clamp_floor_to_zero=True, fourier=True,
                         fourier_init="eye_xavier_norm", fourier_init_norm_gain=0.3, fourier_separate_basis=True,
                         fourier_separate_head=True, fourier_ignore_zero=True, init_device="cpu")
    return FourierEmbedding(config, BufferCache())


def main() -> None:
    torch.manual_seed(0)
    for train_length in (512, 1024):
        theirs = authors_module(train_length)
        ours = pe_lib.FoPEPositionalEmbedding(64, 8, train_length=train_length, num_pairs=theirs.output_dim,
                                              padded="ones")
        assert ours.num_frequencies == theirs.input_dim, (ours.num_frequencies, theirs.input_dim)
        with torch.no_grad():
            ours.cos_coef.copy_(theirs.cos_coef)
            ours.sin_coef.copy_(theirs.sin_coef)
        n = int(sys.argv[1]) if len(sys.argv) > 1 else 2 * train_length
        x = torch.randn(2, 8, n, 64)
        want, got = theirs(x, n), ours(x)                                  # positions 0 .. n - 1
        exact = ours.double()(x.double())
        print(f"L={train_length}, N={n}: D={ours.num_frequencies}, P={ours.num_pairs}; "
              f"max |ours - authors| = {(got - want).abs().max().item():.2e} (float32); "
              f"to float64: authors {(want.double() - exact).abs().max().item():.2e}, "
              f"ours {(got.double() - exact).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
