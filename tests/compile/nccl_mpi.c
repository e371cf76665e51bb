/* Compile test: avgpipe_nccl.h after avgpipe_mpi.h (so <mpi.h> is in): avgpipe_nccl_create_mpi is declared
   and defined; C11, linked against MPI, NCCL and the CUDA runtime. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_mpi.h"
#include "avgpipe_nccl.h"

typedef avgpipe_result (*create_mpi_fn)(avgpipe_context *, const avgpipe_nccl_desc *, MPI_Comm, avgpipe_comm *);

int main(void) {
    volatile create_mpi_fn f = avgpipe_nccl_create_mpi;
    avgpipe_mpi_desc md = avgpipe_mpi_query_defaults(NULL);
    return f != NULL && md.spin_us > 0 && avgpipe_nccl_rank(NULL) == -1 ? 0 : 1;
}
