#!/usr/bin/env bash
# Build an offline bundle of Prism for a host without network: every wheel Prism needs on
# the target that the host does not already provide, as one tar cut into parts.
#
#   scripts/bundle.sh --target cuda|cpu --python X.Y [--host-provides FILE]...
#                     [--part-mib 60] [--extras LIST] [--pyproject FILE] --out DIR
#
# DIR ends up holding prism-bundle.tar.part-00, -01, ... (each at most --part-mib MiB),
# MANIFEST (`name version size_bytes` per wheel) and SHA256SUMS; the tar holds wheels/ and
# MANIFEST. scripts/install_offline.sh installs it there.
#
# --target cuda resolves Prism's `gpu` extra, --target cpu its `cpu` extra; --extras adds
# more (comma list). --host-provides FILE (repeatable, later files win): one package a
# line, `name` (the host's version is used whatever the requirements say) or
# `name==version` (dropped only if that version meets every requirement on it).
# --pyproject reads the requirements from another pyproject.toml (the wheel of Prism is
# still built from this checkout). PYTHON picks the interpreter whose pip resolves.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")

# The header comment is the help text.
usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

die() {
  echo "bundle.sh: $*" >&2
  exit 1
}

target="" python_version="" part_mib=60 extras="" out="" pyproject="$repo/pyproject.toml"
host_lists=()
while (($#)); do
  case $1 in
    --target) target=${2:?}; shift 2 ;;
    --python) python_version=${2:?}; shift 2 ;;
    --host-provides) host_lists+=("${2:?}"); shift 2 ;;
    --part-mib) part_mib=${2:?}; shift 2 ;;
    --extras) extras=${2:?}; shift 2 ;;
    --pyproject) pyproject=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    -h | --help) usage 0 ;;
    *) echo "bundle.sh: unknown argument $1" >&2; usage ;;
  esac
done
[[ -n $target && -n $python_version && -n $out ]] || usage
case $target in
  cuda) extra=gpu ;;
  cpu) extra=cpu ;;
  *) die "--target must be cuda or cpu, not $target" ;;
esac
[[ $python_version =~ ^3\.[0-9]+$ ]] || die "--python must look like 3.12, not $python_version"
[[ $part_mib =~ ^[1-9][0-9]*$ ]] || die "--part-mib must be a positive whole number"
for list in "${host_lists[@]}"; do
  [[ -f $list ]] || die "no such host list: $list"
done
[[ -f $pyproject ]] || die "no such pyproject: $pyproject"

# The target's extra first, then the others, each once.
all_extras=$({ echo "$extra"; tr ',' '\n' <<<"$extras"; } | awk 'NF && !seen[$0]++' | paste -sd, -)

started=$(date +%s)

# The helper needs `packaging`: the checkout's venv has it, else the system's python3.
helper=python3
[[ -x $repo/.venv/bin/python ]] && helper=$repo/.venv/bin/python

# pip evaluates environment markers with the interpreter it runs on, whatever
# --python-version says: resolve with one of the target's version where there is one.
has_version() {
  "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$2'.split('.'))))" \
    2>/dev/null && "$1" -m pip --version >/dev/null 2>&1
}
pyenv_root=$(pyenv root 2>/dev/null || true)
resolver=""
for candidate in "${PYTHON:-}" "$helper" "python$python_version" \
  "$pyenv_root/versions/$python_version"*/bin/"python$python_version"; do
  if [[ -n $candidate ]] && command -v "$candidate" >/dev/null 2>&1 \
    && has_version "$candidate" "$python_version"; then
    resolver=$candidate
    break
  fi
done
if [[ -z $resolver ]]; then
  resolver=${PYTHON:-$helper}
  echo "bundle.sh: no Python $python_version with pip found; resolving with $resolver" \
    "(its markers; the plan re-checks them for $python_version)" >&2
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
# Leftovers of an earlier bundle would be checksummed and shipped with this one.
rm -rf "$out/wheels" "$out/prism-bundle.tar" "$out"/prism-bundle.tar.part-* \
  "$out/MANIFEST" "$out/SHA256SUMS"
work=$(mktemp -d "${TMPDIR:-/tmp}/prism-bundle.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The machine's pip config names a local index folder that may be absent: drop that noise.
noise='is ignored: it is neither a file nor a directory'
quiet() {
  local log
  log=$(mktemp "$work/log.XXXXXX")
  if ! "$@" >"$log" 2>&1; then
    grep -v -- "$noise" "$log" >&2 || true
    return 1
  fi
  grep -v -- "$noise" "$log" >&2 || true
}

platform=(--python-version "$python_version" --implementation cp --abi "cp${python_version/./}")
# Oldest glibc first: pip prefers the platforms in the order given, and a wheel built for
# an older glibc runs on every newer one (llguidance needs manylinux_2_31).
for n in $(seq 17 39); do
  platform+=(--platform "manylinux_2_${n}_x86_64")
done
platform+=(--platform manylinux2014_x86_64)

"$helper" "$here/bundle_plan.py" requirements --pyproject "$pyproject" --extras "$all_extras" \
  >"$work/roots.txt"

echo "resolving Prism[$all_extras] for $target, Python $python_version (pip of $resolver)" >&2
# --target: older pips refuse platform options without it; a dry run writes nothing there.
quiet "$resolver" -m pip install --dry-run --ignore-installed --quiet --only-binary=:all: \
  --report "$work/report.json" "${platform[@]}" --target "$work/unused" -r "$work/roots.txt"

host_args=()
for list in "${host_lists[@]}"; do
  host_args+=(--host-provides "$list")
done
"$helper" "$here/bundle_plan.py" plan --report "$work/report.json" --roots "$work/roots.txt" \
  --target "$target" --python "$python_version" "${host_args[@]}" --out "$work/plan.txt"

echo "downloading $(wc -l <"$work/plan.txt") wheels" >&2
quiet "$resolver" -m pip download --quiet --no-deps --only-binary=:all: "${platform[@]}" \
  -d "$out/wheels" -r "$work/plan.txt"

# Built from a copy: setuptools leaves build/ behind in the tree it builds.
mkdir "$work/src"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | tar -C "$repo" --null --ignore-failed-read -T - -cf - | tar -C "$work/src" -xf -
else
  tar -C "$repo" --exclude=./.venv --exclude=./.git -cf - . | tar -C "$work/src" -xf -
fi
quiet "$helper" -m pip wheel --quiet --no-deps --wheel-dir "$out/wheels" "$work/src"

"$helper" "$here/bundle_plan.py" manifest --wheels "$out/wheels" --plan "$work/plan.txt" \
  --report "$work/report.json" >"$work/MANIFEST"

tar -cf "$out/prism-bundle.tar" --sort=name --owner=0 --group=0 --numeric-owner \
  -C "$out" wheels -C "$work" MANIFEST
part_bytes=$((part_mib * 1024 * 1024))
tar_bytes=$(stat -c %s "$out/prism-bundle.tar")
parts=$(((tar_bytes + part_bytes - 1) / part_bytes))
last=$((parts - 1))
digits=${#last}
((digits >= 2)) || digits=2
split -b "$part_bytes" -d -a "$digits" "$out/prism-bundle.tar" "$out/prism-bundle.tar.part-"
# The parts are what travels; the whole tar and the loose wheels would only double it.
rm -rf "$out/prism-bundle.tar" "$out/wheels"
cp "$work/MANIFEST" "$out/MANIFEST"
(cd "$out" && sha256sum MANIFEST prism-bundle.tar.part-* >SHA256SUMS)

elapsed=$(($(date +%s) - started))
awk -v parts="$parts" -v mib="$part_mib" -v out="$out" -v secs="$elapsed" '
  { total += $3 }
  END {
    printf "%d wheels, %.1f MiB, %d parts of at most %d MiB in %s (%dm%02ds)\n",
      NR, total / 1048576, parts, mib, out, secs / 60, secs % 60
  }' "$out/MANIFEST"
