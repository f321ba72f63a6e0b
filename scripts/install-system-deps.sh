#!/usr/bin/env bash
# Installs Mesa's lavapipe Vulkan driver (software WebGPU adapter for wgpu and the ONNX Runtime
# WebGPU plugin EP). Debian 12 needs bookworm-backports (stock Mesa 22 is rejected by Dawn); the
# apt source reuses the archive URI this machine already lists -- no host name is written here.
# Idempotent; does nothing when not root or when a new enough lavapipe is already installed.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "install-system-deps: not root, skipping apt" >&2; exit 0; }
have=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)
case "$have" in 2[3-9].*|[3-9][0-9].*) exit 0 ;; esac
. /etc/os-release
export DEBIAN_FRONTEND=noninteractive
if [ "${VERSION_CODENAME:-}" = bookworm ]; then
  SRC=/etc/apt/sources.list.d/debian.sources
  URI=$(awk '
    /^[ \t]*$/ { if (ok && uri != "") { print uri; done = 1; exit }
                 ok = 0; uri = ""; next }
    /^URIs:/   { uri = $2 }
    /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "bookworm") ok = 1 }
    END        { if (!done && ok && uri != "") print uri }
  ' "$SRC")
  test -n "$URI" || { echo "no bookworm URI in $SRC" >&2; exit 1; }
  cat > /etc/apt/sources.list.d/bookworm-backports.sources <<SRC
Types: deb
URIs: $URI
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  apt-get update -qq
  apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers >/dev/null
else
  apt-get update -qq
  apt-get install -y -qq mesa-vulkan-drivers >/dev/null
fi
echo "install-system-deps: mesa-vulkan-drivers $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers)"
