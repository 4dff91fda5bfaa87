#!/bin/bash
# One lent-GPU call: the next GPU-queue chunks on the GPU, mutation testing of MUT_MODULES on
# MUT_CHILDREN of the CPU cores beside them (JAX on CPU there), everything packed into $OUT.
set -u
cd "$(dirname "$0")/.."
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JFED_DATA_DIR=$PWD/.data PYTHONUNBUFFERED=1
nvidia-smi -L; nproc; python3 -c "import jax, flax, optax, ml_collections, ott, dp_accounting, experiments.fedhydra_tables; print('jax', jax.__version__, jax.devices())" || exit 1
git init -q . && printf '/.data/\n/.whl/\n/.device/\n/.ref/\n' >> .git/info/exclude
mut=
[ "${MUT_S:-465}" -gt 0 ] && (JAX_PLATFORMS=cpu timeout ${MUT_S:-465} nice -n 10 python3 -m experiments.dev.mutation \
   --modules=${MUT_MODULES:-fedhydra,distill_losses} --max_children=${MUT_CHILDREN:-12} \
   --out=/tmp/mutation_out > /tmp/mutation.log 2>&1) &
[ "${MUT_S:-465}" -gt 0 ] && mut=$!
# KD steps one call each vs KD_BLOCK per call (jfed.distill.kd.kd_block_size picks blocks off CPU)
[ "${KD_S:-0}" -gt 0 ] && timeout ${KD_S} python3 -m experiments.bench.model_stratification --stages=hydra_kd \
   --pool=65536 --out=$OUT/hydra_kd_blocks_gpu.json > $OUT/hydra_kd_blocks_gpu.log 2>&1
# Batched MS in float32 and bf16 at m = 100, batch 256 (issue 34 item 4): TFLOP/s against the
# device's dense peak, and FedHydra's accuracy with bf16 MS on digits (three seeds)
[ "${MS_S:-0}" -gt 0 ] && timeout ${MS_S} python3 -m experiments.bench.model_stratification --stages=ms \
   --forms=loop,batched,batched_bf16,batched_clients,batched_clients_bf16 --clients=100 \
   --ms_batch=256 --seq_runs=20 --out=$OUT/ms_bf16_gpu.json > $OUT/ms_bf16_gpu.log 2>&1
[ "${MS_S:-0}" -gt 0 ] && timeout ${MS_S} python3 -m experiments.ms_precision \
   --config=experiments/configs/fedhydra_digits.py:quick --config.fedhydra.ms_impl=batched \
   --out=/tmp/ms_precision --doc=$OUT/ms_precision_digits_gpu.md > $OUT/ms_precision_gpu.log 2>&1
python3 -m experiments.dev.gpu_queue --next --parallel=${PARALLEL:-3} --limit_s=${LIMIT_S:-430} --out=$OUT
if [ -n "$mut" ]; then
  wait $mut; pkill -f mutmut; sleep 2; tail -5 /tmp/mutation.log
  mkdir -p /tmp/mutation_out; cp /tmp/mutation.log /tmp/mutation_out/
  tar czf $OUT/mutation.tar.gz -C /tmp mutation_out
  # the verdicts so far (experiments.dev.mutation --state, runs/mutation/state: git ignores it, so
  # the device call carries it): unpacked here, a module stopped part-way resumes from them
  # (`tar xzf mutation_state.tar.gz` in the repository's root)
  tar czf $OUT/mutation_state.tar.gz runs/mutation/state
fi
ls -la $OUT; echo "total $(( $(date +%s) - t0 )) s"
