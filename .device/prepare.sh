#!/bin/bash
# Prepares what `.device/run.sh` needs on a lent GPU machine, here, once per checkout:
#   .whl/   the wheels jfed (and mutmut) need beyond that machine's image (Python 3.12, x86-64),
#           with the missing dependencies; the image has jax, flax, optax, orbax, torch, ...
#   .data/  Fashion-MNIST's IDX files, from Debian's dataset-fashion-mnist.
#   .ref/   the authors' checkouts the GPU queue's parity chunks run (experiments/parity), copied
#           from PARITY_REFS="dense=/path/to/DENSE checkout,..." (none copied when unset), with
#           the wheels of their pure-Python dependencies in .whl/.
# All three are ignored by git and travel with `carry: [".whl", ".data", ".ref"]`:
#   bash .device/run.sh    (MUT_MODULES, MUT_CHILDREN, MUT_S, KD_S, LIMIT_S override its defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
for p in /.whl/ /.data/ /.ref/; do grep -qxF "$p" .git/info/exclude || echo "$p" >> .git/info/exclude; done
mkdir -p .whl .data/fashion-mnist
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 any; do
  platforms="$platforms --platform $p"
done
# jfed's dependencies the image lacks, then mutmut's and theirs (one version of each)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $platforms -d .whl \
  ml-collections ott-jax jaxopt tensorboardX dp-accounting dm-tree \
  mutmut libcst setproctitle textual "click>=8.4.2" platformdirs mdit-py-plugins \
  linkify-it-py uc-micro-py kornia kornia_rs tqdm
src=/usr/share/datasets/fashion-mnist
if [ ! -d "$src" ]; then
  $(command -v sudo || true) apt-get install -y -q dataset-fashion-mnist
fi
cp "$src"/*.gz .data/fashion-mnist/
if [ -n "${PARITY_REFS:-}" ]; then
  mkdir -p .ref
  IFS=',' read -ra refs <<< "$PARITY_REFS"
  for pair in "${refs[@]}"; do
    name="${pair%%=*}"; path="${pair#*=}"
    rm -rf ".ref/$name" && cp -r "$path" ".ref/$name" && rm -rf ".ref/$name/.git"
  done
fi
du -sh .whl .data .ref 2>/dev/null || true
