#!/usr/bin/env bash
# Install a bundle made by scripts/bundle.sh, with no network at all.
#
#   scripts/install_offline.sh DIR [TARGET_DIR]
#
# Checks DIR's SHA256SUMS, joins the parts and installs every wheel with pip --no-index
# --no-deps: into TARGET_DIR (pip --target) when given, else into ./.venv, made with
# $PYTHON (default python3). Prints what to export at the end.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}

die() {
  echo "install_offline.sh: $*" >&2
  exit 1
}

if (($# < 1 || $# > 2)) || [[ $1 == -h || $1 == --help ]]; then
  # The header comment is the help text.
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit 2
fi
dir=$(cd "$1" && pwd)
target_dir=${2:-}
venv=$PWD/.venv
# Never pour a bundle into a venv this script did not make (a checkout's own, say).
if [[ -z $target_dir && -e $venv && ! -e $venv/.prism-offline ]]; then
  die "$venv exists and was not made by this script: remove it, or give TARGET_DIR"
fi

[[ -f $dir/SHA256SUMS ]] || die "$dir has no SHA256SUMS"
parts=("$dir"/prism-bundle.tar.part-*)
[[ -e ${parts[0]} ]] || die "$dir has no prism-bundle.tar.part-*"
# A part SHA256SUMS does not list would go into the tar unchecked.
for part in "${parts[@]}"; do
  grep -q " [ *]$(basename "$part")\$" "$dir/SHA256SUMS" || die "SHA256SUMS does not list $part"
done
(cd "$dir" && sha256sum --quiet -c SHA256SUMS) || die "checksums do not match"
echo "checksums of ${#parts[@]} parts match" >&2

# Unpack beside the bundle when DIR is writable, else in /tmp.
unpack=$(mktemp -d "$dir/.unpack.XXXXXX" 2>/dev/null || mktemp -d "${TMPDIR:-/tmp}/prism-bundle.XXXXXX")
trap 'rm -rf "$unpack"' EXIT
cat "${parts[@]}" | tar -xf - -C "$unpack"
wheels=("$unpack"/wheels/*.whl)
[[ -e ${wheels[0]} ]] || die "the bundle holds no wheels"
listed=$(wc -l <"$unpack/MANIFEST")
((${#wheels[@]} == listed)) || die "the bundle holds ${#wheels[@]} wheels, its MANIFEST $listed"

# --no-compile: byte-compiling ~100 packages takes minutes of the host's short lease.
pip_args=(install --quiet --no-index --no-deps --no-compile --disable-pip-version-check)
if [[ -n $target_dir ]]; then
  mkdir -p "$target_dir"
  target_dir=$(cd "$target_dir" && pwd)
  py=$python
  export PYTHONPATH="$target_dir${PYTHONPATH:+:$PYTHONPATH}"
  # --upgrade: without it pip --target skips every folder already there, so a second run
  # would keep the first one's files.
  "$py" -m pip "${pip_args[@]}" --upgrade --target "$target_dir" "${wheels[@]}"
else
  [[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
  touch "$venv/.prism-offline"
  py=$venv/bin/python
  "$py" -m pip "${pip_args[@]}" "${wheels[@]}"
fi

# The torch import would load: a CPU build means PyPI's CUDA torchvision must be stripped.
torch_version=$("$py" -c '
import importlib.metadata as metadata
try:
    print(metadata.version("torch"))
except metadata.PackageNotFoundError:
    pass
')
if [[ $torch_version == *+cpu ]]; then
  [[ -f $here/strip_torchvision.py ]] || die "torch $torch_version needs $here/strip_torchvision.py"
  "$py" "$here/strip_torchvision.py"
fi

echo "installed ${#wheels[@]} wheels (torch: ${torch_version:-none})"
echo "to use them:"
if [[ -n $target_dir ]]; then
  echo "  export PYTHONPATH=\"$target_dir\${PYTHONPATH:+:\$PYTHONPATH}\""
  echo "  export PATH=\"$target_dir/bin:\$PATH\""
else
  echo "  source $venv/bin/activate"
fi
# flashinfer stays out of GPU bundles: vLLM's sampler must not reach for it.
if grep -q '^vllm ' "$unpack/MANIFEST" && ! grep -q '^flashinfer-python ' "$unpack/MANIFEST"; then
  echo "  export VLLM_USE_FLASHINFER_SAMPLER=0"
fi
