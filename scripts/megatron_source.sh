#!/usr/bin/env bash
# Set up Megatron-Core's pure-Python source (megatron/core) at a release tag, for the tests that
# run ckptd's Megatron bridge against a Megatron-Core newer than the installable wheel
# (tests/compat/test_megatron_source.py).  Prints the CKPTD_MEGATRON_SRC=... line to use.
#
#   scripts/megatron_source.sh GIT_DIR_OR_CHECKOUT [TAG] [DEST]
#
# GIT_DIR_OR_CHECKOUT: a Megatron-LM clone (bare git directory or checkout) that has TAG;
# TAG: default core_v0.19.0; DEST: default .megatron-src/TAG under this repository (git-ignored).
# Only megatron/core is extracted (git archive); nothing is built or installed.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 3 ]; then
    sed -n '5,9p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
source_repo=$1
tag=${2:-core_v0.19.0}
repo_root=$(cd "$(dirname "$0")/.." && pwd)
dest=${3:-$repo_root/.megatron-src/$tag}

if git --git-dir="$source_repo" rev-parse --git-dir >/dev/null 2>&1 && [ ! -d "$source_repo/.git" ]; then
    git_cmd=(git --git-dir="$source_repo")
else
    git_cmd=(git -C "$source_repo")
fi
if ! "${git_cmd[@]}" rev-parse --verify --quiet "refs/tags/$tag^{commit}" >/dev/null; then
    echo "megatron_source.sh: $source_repo has no tag $tag; tags there:" >&2
    "${git_cmd[@]}" tag --list 'core_*' | sort -V | tail -n 12 >&2
    exit 1
fi

tmp=$(mktemp -d "${dest%/}.tmp.XXXXXX" 2>/dev/null || { mkdir -p "$(dirname "$dest")" && mktemp -d "${dest%/}.tmp.XXXXXX"; })
trap 'rm -rf "$tmp"' EXIT
"${git_cmd[@]}" archive "$tag" megatron/core | tar -x -C "$tmp"
test -f "$tmp/megatron/core/dist_checkpointing/serialization.py"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT

version=$(cd "$dest" && NO_VCS_VERSION=1 python3 -c 'import runpy; i = runpy.run_path("megatron/core/package_info.py"); print(i["__version__"])' 2>/dev/null || echo unknown)
echo "megatron/core of $tag (package_info says $version) is in $dest" >&2
echo "CKPTD_MEGATRON_SRC=$dest"
