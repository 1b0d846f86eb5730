export PYTHONUNBUFFERED=1 PYTHONPATH=.
( timeout 170 python3 -m pytest test_positional_embeddings.py -k "cuda" -n 12 -p no:cacheprovider -p no:logging --tb=short -q -o addopts="" > $OUT/cuda_tests.log 2>&1; grep -E "^(FAILED|E  .*Error)|passed|failed" $OUT/cuda_tests.log | cut -c1-300 | head -40 )
for w in a b c rope; do timeout 60 python3 .gpu/checks.py $w 2>&1 | grep -E "^(T5|RoPE)|Error" | head -3; done | tee $OUT/checks.log
( timeout 120 python3 benchmarks/bench.py gpu --regime "reused memory" --reps 6 --only t5,alibi,fire,forgetting,rotary 2>&1 ) | grep -v "^W11" > $OUT/bench_gpu.log; grep -E "^  [a-zA-Z]|^GPU" $OUT/bench_gpu.log
