# Sourced by the example scripts: where ptdp and mpirun are, and a folder for the outputs.
#   PTDP    the ptdp binary (default: build/cli/ptdp of this checkout)
#   MPIRUN  the MPI launcher (default: mpirun)
#   OUT     where the example writes its files (default: a new temporary folder)
set -euo pipefail
EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PTDP=${PTDP:-$EXAMPLES/../build/cli/ptdp}
MPIRUN=${MPIRUN:-mpirun}
OUT=${OUT:-$(mktemp -d -t ptdp-example-XXXXXX)}
mkdir -p "$OUT"
[ -x "$PTDP" ] || { echo "ptdp not found at $PTDP (build it, or set PTDP)" >&2; exit 1; }
# OpenMPI inside containers: no CMA single-copy, root allowed, more ranks than cores allowed.
export OMPI_MCA_btl_vader_single_copy_mechanism=none
mpirun_np() {
  local np=$1
  shift
  "$MPIRUN" --allow-run-as-root --oversubscribe -np "$np" "$@" </dev/null
}
