/* Compile test: avgpipe_hwloc.h resolving CUDA ordinals through the CUDA runtime (hwloc/cudart.h), C11,
   linked against cudart. Runs without a GPU: the XML topology of hwloc_impl.c is not this machine, so
   the CUDA runtime is never asked; an ordinal it lacks is an error naming it. */
#define AVGPIPE_HWLOC_CUDART 1
#define main hwloc_impl_main
#include "hwloc_impl.c"
#undef main

int main(void) {
    avgpipe_context ctx;
    avgpipe_hwloc_topo_desc td;
    avgpipe_hwloc_placement_desc pd;
    avgpipe_hwloc_topo *topo = NULL;
    avgpipe_hwloc_placement *plan = NULL;
    const char *gpus[1] = {"cuda0"};
    avgpipe_result r;
    memset(&td, 0, sizeof td);
    memset(&pd, 0, sizeof pd);
    avgpipe_context_init(&ctx, NULL);
    td.xml = xml;
    pd.count = 1, pd.gpus = gpus;
    if (hwloc_impl_main() != 0 || avgpipe_hwloc_topo_load(&ctx, &td, &topo) != AVGPIPE_OK) return 1;
    r = avgpipe_hwloc_placement_create(&ctx, topo, &pd, &plan);
    avgpipe_hwloc_topo_free(topo);
    return r == AVGPIPE_INVALID_ARG && strstr(avgpipe_last_error(&ctx), "cuda0") ? 0 : 1;
}
