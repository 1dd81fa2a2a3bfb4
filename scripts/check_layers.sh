#!/usr/bin/env bash
# The layer rule of DESIGN.md, checked: a file under src/<layer>/ or include/deepinfer/<layer>/ may include
# public headers of its own layer and of the layers below it only (and never reach into another directory
# with "../"). Prints each violation as FILE:LINE: INCLUDE (layer -> layer) and exits 1 when there is one.
# Run by CTest (test `layers`), so `make test` and CI fail on a breaking include.
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A allowed=(
  [core]="core"
  [kernels]="kernels core"
  [backend]="backend kernels core"
  [model]="model backend core"
  [kvcache]="kvcache core"
  [engine]="engine kvcache model backend core"
  [recipe]="recipe core"
  [server]="server recipe engine kvcache core"
  [router]="router server recipe engine kvcache core"
  [python]="python recipe core"
)
violations=0
for dir in src/* include/deepinfer/*; do
  [ -d "$dir" ] || continue
  layer=$(basename "$dir")
  if [ -z "${allowed[$layer]+x}" ]; then
    echo "$dir: a layer DESIGN.md does not name; add it to scripts/check_layers.sh" >&2
    violations=1
    continue
  fi
  while IFS= read -r hit; do
    file=${hit%%:*}
    rest=${hit#*:}
    line=${rest%%:*}
    include=${rest#*:}
    if [[ $include =~ \"deepinfer/([a-z_]+)/ ]]; then
      target=${BASH_REMATCH[1]}
      if [[ " ${allowed[$layer]} " != *" $target "* ]]; then
        echo "$file:$line: $include ($layer -> $target breaks the layer rule)"
        violations=1
      fi
    elif [[ $include =~ \"\.\./ ]]; then
      echo "$file:$line: $include (a relative include out of the layer's directory)"
      violations=1
    fi
  done < <(grep -rnE '^\s*#\s*include\s+"' "$dir" --include='*.h' --include='*.cpp' --include='*.cu' --include='*.cuh' || true)
done
if ((violations)); then
  echo "scripts/check_layers.sh: includes that break DESIGN.md's layer rule (above)" >&2
  exit 1
fi
echo "layers: every include follows DESIGN.md's layer rule"
