#!/usr/bin/env bash
# Put a self-contained redis-server (and redis-cli) into DEST for the GPU machine, which has no
# redis and no package mirror. The binaries come from the distribution's redis-tools package;
# every shared library they link, except glibc's and the C++ runtime (always there), is copied
# beside them and found through a wrapper's LD_LIBRARY_PATH, so nothing leaks into other
# programs' library search (a global LD_LIBRARY_PATH would shadow the device's own libssl).
#
# Usage: bundle_redis.sh DEB_CACHE_DIR DEST    (DEST gets bin/, lib/ and VERSION)
set -euo pipefail
debs=$1
dest=$2
pkgs=(redis-tools liblzf1 libjemalloc2)

mkdir -p "$debs"
have_all=1
for p in "${pkgs[@]}"; do compgen -G "$debs/${p}_*.deb" > /dev/null || have_all=0; done
if [ "$have_all" = 0 ]; then
  (cd "$debs" && apt-get download "${pkgs[@]}" 2> /dev/null) \
    || { apt-get update -qq && (cd "$debs" && apt-get download "${pkgs[@]}"); }
fi

x=$(mktemp -d)
trap 'rm -rf "$x"' EXIT
for p in "${pkgs[@]}"; do
  deb=$(ls "$debs/${p}"_*.deb | sort -V | tail -1)
  dpkg -x "$deb" "$x"
done
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
# redis-server is redis-check-rdb under another name: the binary picks its mode from argv[0].
cp "$x/usr/bin/redis-check-rdb" "$dest/bin/redis-server.real"
cp "$x/usr/bin/redis-cli" "$dest/bin/redis-cli.real"
cp -L "$x"/usr/lib/x86_64-linux-gnu/liblzf.so.1 "$x"/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 "$dest/lib/"

# The rest of what the binaries link, as this machine resolves it (glibc and libstdc++ excluded).
skip='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s)\.so'
for bin in "$dest"/bin/*.real; do
  LD_LIBRARY_PATH="$dest/lib" ldd "$bin" | while read -r lib _ path _; do
    [[ "${lib##*/}" =~ $skip ]] && continue
    [ -e "$dest/lib/$lib" ] && continue
    if [ "$path" = "not" ] || [ ! -e "$path" ]; then
      echo "bundle_redis: $lib not found for $bin (install the package that has it)" >&2
      exit 1
    fi
    cp -L "$path" "$dest/lib/"
  done
done

for name in redis-server redis-cli; do
  cat > "$dest/bin/$name" << 'EOF'
#!/bin/sh
# Runs the bundled binary with the libraries beside it (scripts/gpu/bundle_redis.sh).
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/$(basename "$0").real" "$@"
EOF
  chmod +x "$dest/bin/$name"
done
version=$("$dest/bin/redis-server" --version)
deb_version=$(dpkg-deb -f "$(ls "$debs"/redis-tools_*.deb | sort -V | tail -1)" Version)
echo "# redis: $version (redis-tools $deb_version); libs: $(ls "$dest/lib" | tr '\n' ' ')" > "$dest/VERSION"
cat "$dest/VERSION"
