#!/usr/bin/env bash
# llama.cpp's own HF -> GGUF converter, for the GGUF tests (tests/models/test_gguf_families.py): taken from
# the llama-cpp-python source package on PyPI (its vendored llama.cpp), nothing built. Idempotent, and safe
# to kill halfway: it unpacks into a temporary folder and renames it into place at the end.
#   tests/tools/fetch_gguf_converter.sh PIP DEST
set -euo pipefail
PIP=$1
DEST=$2
VERSION=0.3.36
[ -f "$DEST/convert_hf_to_gguf.py" ] && exit 0
TMP="$DEST.tmp.$$"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP"
"$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP"
SRC="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$TMP/llama_cpp_python-$VERSION.tar.gz" -C "$TMP" --strip-components=3 \
    "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py"
rm "$TMP/llama_cpp_python-$VERSION.tar.gz"
rm -rf "$DEST"
mv "$TMP" "$DEST"
