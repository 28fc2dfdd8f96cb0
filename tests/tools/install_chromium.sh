#!/bin/sh
# Debian's chromium for the /kv page test (tests/entrypoints/openai/test_kv_page.py), where this user may
# install packages: root with apt-get. Elsewhere it says why and the test skips with the same reason.
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium not installed (needs root and apt-get: apt-get install chromium); the /kv page test will skip"
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
