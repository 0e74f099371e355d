#!/usr/bin/env bash
# Builds the logic-gate peer, difflogic 0.1.0, from its source distribution carried in .peers/ (no network on
# the GPU machine; fetched with curl as ../shared/peers.md says). sm_90 only, ~120 s on 16 cores. Its code is
# never committed: it is unpacked and built under /tmp. Writes /tmp/difflogic_build.done (with the exit
# status) when finished, so a benchmark can wait for it.
set -uo pipefail
cd "$(dirname "$0")/../.."
tarball=$(ls .peers/difflogic-*.tar.gz 2>/dev/null | head -1)
rm -f /tmp/difflogic_build.done
if [ -z "$tarball" ]; then echo "no .peers/difflogic-*.tar.gz"; echo 1 > /tmp/difflogic_build.done; exit 1; fi
work=$(mktemp -d)
tar -xzf "$tarball" -C "$work"
src=$(ls -d "$work"/difflogic-*/)
cd "$src"
# The recipe of peers.md: its extension uses tensor.type() APIs current torch removed.
kernel=difflogic/cuda/difflogic_kernel.cu
if [ ! -f "$kernel" ]; then echo "$kernel not found: the sdist changed"; echo 1 > /tmp/difflogic_build.done; exit 1; fi
sed -i 's/\.type()\.is_cuda()/.is_cuda()/; s/AT_DISPATCH_\([A-Z_]*\)(\([a-z_]*\)\.type()/AT_DISPATCH_\1(\2.scalar_type()/' \
  "$kernel"
MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=9.0 python3 -m pip install -q --no-index --no-build-isolation --no-deps .
rc=$?
echo $rc > /tmp/difflogic_build.done
exit $rc
