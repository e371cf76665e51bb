#!/bin/sh
# meson install puts the headers and the pkg-config files in place, and a program outside the tree builds
# against the installed copy with nothing but pkg-config: tests/install/use_avgpipe.c through
# `pkg-config --cflags --libs avgpipe`, and (when avgpipe-mpi.pc was installed and mpirun is given)
# tests/install/use_avgpipe_mpi.c through `pkg-config --cflags --libs avgpipe-mpi`, run on 2 processes.
# Installs into a temporary DESTDIR (nothing outside it is touched) from the configured build directory.
#
#   usage: tests/install_test.sh SOURCE_ROOT BUILD_DIR CC [MPIRUN]
# Prints a line per step and a last line "N passed, M failed"; exits 1 when anything failed.
[ $# -ge 3 ] || { echo "usage: $0 SOURCE_ROOT BUILD_DIR CC [MPIRUN]" >&2; exit 2; }
src=$1 build=$2 cc=$3 mpirun=${4:-}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/avgpipe_install.XXXXXX") || exit 2
trap 'rm -rf "$tmp"' EXIT
trap 'exit 2' INT TERM
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok: $*"; }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; sed 's/^/    /' "$tmp/log" | head -n 20; }
finish() { echo "$pass passed, $fail failed"; [ "$fail" -eq 0 ]; exit $?; }

if meson install -C "$build" --no-rebuild --destdir "$tmp/root" >"$tmp/log" 2>&1; then ok "meson install --destdir"; else bad "meson install"; finish; fi
pcdir=$(dirname "$(find "$tmp/root" -name avgpipe.pc | head -n 1)")
inc=$(find "$tmp/root" -name avgpipe.h | head -n 1)
if [ -f "$pcdir/avgpipe.pc" ] && [ -n "$inc" ]; then ok "installed avgpipe.pc ($pcdir) and avgpipe.h ($(dirname "$inc"))"; else bad "no avgpipe.pc or avgpipe.h under the DESTDIR"; finish; fi
for h in avgpipe.h avgpipe_mpi.h avgpipe_cuda.h avgpipe_nccl.h avgpipe_hwloc.h; do
    if cmp -s "$(dirname "$inc")/$h" "$src/$h"; then ok "installed $h is the source's"; else : >"$tmp/log"; bad "installed $h missing or different"; fi
done
# The .pc files name the configured prefix; point the installed ones at the DESTDIR copy (only ours: MPI's stay).
prefix=$(sed -n 's/^prefix=//p' "$pcdir/avgpipe.pc")
for pc in "$pcdir"/avgpipe*.pc; do sed -i "s|^prefix=.*|prefix=$tmp/root$prefix|" "$pc"; done
export PKG_CONFIG_PATH="$pcdir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
if [ "$(pkg-config --modversion avgpipe)" = "$(sed -n 's/^#define AVGPIPE_VERSION_STRING "\(.*\)"/\1/p' "$src/avgpipe.h")" ]; then
    ok "pkg-config --modversion avgpipe = AVGPIPE_VERSION_STRING"
else
    : >"$tmp/log"; bad "pkg-config --modversion avgpipe is '$(pkg-config --modversion avgpipe)'"
fi
mkdir "$tmp/work" # outside the source tree: only pkg-config says where the headers are
cp "$src/tests/install/use_avgpipe.c" "$src/tests/install/use_avgpipe_mpi.c" "$tmp/work/"
cd "$tmp/work" || exit 2
# shellcheck disable=SC2046 # pkg-config's output is meant to be split
if $cc -std=c11 -Wall -Wextra -Werror $(pkg-config --cflags avgpipe) use_avgpipe.c -o use_avgpipe $(pkg-config --libs avgpipe) >"$tmp/log" 2>&1; then
    ok "built use_avgpipe.c with pkg-config --cflags --libs avgpipe"
    if timeout 60 ./use_avgpipe >"$tmp/log" 2>&1; then ok "use_avgpipe: $(tail -n 1 "$tmp/log")"; else bad "use_avgpipe exited $?"; fi
else
    bad "building use_avgpipe.c against the installed copy"
fi
if [ -f "$pcdir/avgpipe-mpi.pc" ] && [ -n "$mpirun" ]; then
    # shellcheck disable=SC2046
    if $cc -std=c11 -Wall -Wextra -Werror $(pkg-config --cflags avgpipe-mpi) use_avgpipe_mpi.c -o use_avgpipe_mpi $(pkg-config --libs avgpipe-mpi) >"$tmp/log" 2>&1; then
        ok "built use_avgpipe_mpi.c with pkg-config --cflags --libs avgpipe-mpi"
        if OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout -k 5 120 "$mpirun" --oversubscribe --bind-to none -np 2 ./use_avgpipe_mpi >"$tmp/log" 2>&1 &&
            [ "$(grep -c 'allreduce 3 (want 3)' "$tmp/log")" -eq 2 ]; then
            ok "use_avgpipe_mpi on 2 processes: $(grep -m1 allreduce "$tmp/log")"
        else
            bad "use_avgpipe_mpi under mpirun -np 2"
        fi
    else
        bad "building use_avgpipe_mpi.c against the installed copy"
    fi
elif [ -n "$mpirun" ]; then
    : >"$tmp/log"; bad "mpirun given but no avgpipe-mpi.pc was installed"
fi
finish
