#!/usr/bin/env bash
# Debian's nginx (apt, needs root). The benchmarks run it in the foreground with a generated configuration in
# a temporary directory (loadtest/peers/nginx.py), never as the system service: the package's service is not
# started here (in containers policy-rc.d forbids it anyway) and is stopped if the install started it.
# Idempotent: nothing is done when nginx $NGINX_VERSION is installed.
source "$(dirname "$0")/_lib.sh"
if command -v nginx >/dev/null && nginx -v 2>&1 | grep -q "nginx/$NGINX_VERSION\$"; then
    echo "nginx: $NGINX_VERSION already installed at $(command -v nginx)"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "nginx: installing needs root (apt-get install nginx=$NGINX_VERSION-*)" >&2
    exit 1
fi
started=$SECONDS
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "nginx=$NGINX_VERSION-*" >/dev/null
if command -v systemctl >/dev/null && systemctl is-active --quiet nginx 2>/dev/null; then
    systemctl stop nginx && systemctl disable --quiet nginx
fi
size_kb=$(( $(dpkg-query -W -f='${Installed-Size}+' nginx nginx-common) 0 ))
record_install nginx "$(nginx -v 2>&1 | sed 's|.*nginx/||')" $((SECONDS - started)) $((size_kb / 1024)) "$(command -v nginx)"
