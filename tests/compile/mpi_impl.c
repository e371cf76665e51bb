/* Compile test: avgpipe_mpi.h with its implementation (AVGPIPE_IMPLEMENTATION turns both on), C11. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_mpi.h"

int main(void) {
    avgpipe_mpi_desc d = avgpipe_mpi_query_defaults(NULL);
    return d.spin_us > 0 && avgpipe_mpi_rank(NULL) == -1 ? 0 : 1;
}
