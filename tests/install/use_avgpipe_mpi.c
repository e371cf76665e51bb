/* Built by tests/install_test.sh outside the source tree against the installed headers with nothing but
   `pkg-config --cflags --libs avgpipe-mpi`, and run by mpirun on 2 processes: the MPI comm backend's
   rank-order allreduce over the two. Exit status 0 when each process gets 1 + 2. */
#define AVGPIPE_IMPLEMENTATION
#include <avgpipe.h>
#include <avgpipe_mpi.h>

#include <stdio.h>

int main(int argc, char **argv) {
    avgpipe_comm comm;
    int rank = 0, ok;
    float x;
    if (avgpipe_mpi_init(NULL, &argc, &argv) != AVGPIPE_OK || avgpipe_mpi_create(NULL, NULL, &comm) != AVGPIPE_OK) {
        fprintf(stderr, "avgpipe_mpi_create: %s\n", avgpipe_last_error(NULL));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    x = (float)(rank + 1);
    ok = comm.size == 2 && comm.allreduce_sum(comm.user, rank, &x, 1, 30.0) == AVGPIPE_OK && x == 3.0f;
    printf("rank %d of %d: allreduce %g (want 3)\n", rank, comm.size, (double)x);
    avgpipe_comm_destroy(&comm);
    MPI_Finalize();
    return ok ? 0 : 1;
}
