#!/usr/bin/env bash
# Builds OUT.tar.xz: the Python packages the GPU machine's image (CPython 3.12, x86-64) lacks and this
# project needs there (transformers newer than the image's, deepspeed, fla, decord, av, ...), installed
# flat with `pip install --no-index --no-deps --target`. Nothing can be installed on that machine and a
# call may carry only 64 MiB, so the pack is one tar.xz of the installed tree rather than the wheels.
# There:  mkdir -p /tmp/site && tar -xJf OUT.tar.xz -C /tmp/site && export PYTHONPATH=$PWD/src:/tmp/site
#
# Usage: bash bench/gpu_site.sh OUT.tar.xz [PYTHON312]
set -euo pipefail

# Everything else the code needs there (torch, triton, numpy, tokenizers, ...) is in the image already.
PACKAGES=(
  transformers deepspeed fla-core flash-linear-attention decord av hjson
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
  jsonschema jsonschema-specifications referencing rpds-py tensorboardx
  opentimelineio otio-cmx3600-adapter otio-fcp-adapter
)

die() { echo "gpu_site.sh: $*" >&2; exit 1; }
[[ $# -ge 1 && $# -le 2 ]] || die "usage: bash bench/gpu_site.sh OUT.tar.xz [PYTHON312]"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "$1")

is312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
py=${2:-}
if [[ -z $py ]]; then
  # A pyenv shim named python3.12 can exist and still refuse to run, hence the trial run.
  for c in python3.12 /root/.pyenv/versions/3.12.*/bin/python; do
    if is312 "$c"; then py=$c; break; fi
  done
  [[ -n $py ]] || die "no Python 3.12 found (python3.12 on PATH, /root/.pyenv/versions/3.12.*/bin/python); pass one"
fi
is312 "$py" || die "$py is not a working Python 3.12"

# fla is not in constraints.txt (the CPU tests never install it); its pin is the `gpu` extra's.
fla=$(grep -o '"flash-linear-attention==[^"]*"' "$root/pyproject.toml" | tr -d '"' | cut -d= -f3)
[[ -n $fla ]] || die "pyproject.toml pins no flash-linear-attention==VERSION"
version() {
  case $1 in
    fla-core|flash-linear-attention) echo "$fla" ;;
    *) awk -F'==' -v n="$1" 'tolower($1) == n { print $2 }' "$root/constraints.txt" ;;
  esac
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
binary=()
for p in "${PACKAGES[@]}"; do
  v=$(version "$p")
  [[ -n $v ]] || die "constraints.txt has no version for $p"
  if [[ $p == deepspeed ]]; then ds=$v; else binary+=("$p==$v"); fi
done

start=$SECONDS
# decord's only Linux wheel is tagged manylinux2010.
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$work/wheels" \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 \
  --platform any "${binary[@]}"

# deepspeed publishes only an sdist. DS_BUILD_OPS=0 compiles no ops (they need torch and CUDA), so the
# wheel is pure Python; its build tools go in a throwaway venv, pinned from constraints.txt. A fixed hash
# seed keeps the order of its extras (a set in setup.py) in METADATA the same from one build to the next.
"$py" -m venv "$work/build"
"$work/build/bin/pip" install -q "setuptools==$(version setuptools)" "packaging==$(version packaging)"
DS_BUILD_OPS=0 PYTHONHASHSEED=0 "$work/build/bin/pip" wheel -q --no-deps --no-build-isolation --use-pep517 \
  --no-binary=:all: -w "$work/wheels" "deepspeed==$ds"

"$py" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$work"/wheels/*.whl
find "$work/site" -name __pycache__ -type d -prune -exec rm -rf {} +
mkdir -p "$(dirname "$out")"
(cd "$work/site" && tar -cf - . | xz -6 -T2 > "$out")

size=$(stat -c %s "$out")
echo "$out: $((size / 1000000)) MB ($size bytes), built in $((SECONDS - start)) s"
(cd "$work/site" && ls -d -- *.dist-info | sed -E 's/^(.*)-([^-]*)\.dist-info$/  \1==\2/')
((size <= 50000000)) || die "the pack is over 50 MB; with the other archives a call carries it would not fit in 64 MiB"
