/* Compile test: avgpipe_hwloc.h with its implementation (AVGPIPE_IMPLEMENTATION turns both on), C11; a
   second include of either header is harmless. Runs: a plan of a one-core XML topology. */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_hwloc.h"
#include "avgpipe_hwloc.h"

#include <string.h>

static const char xml[] =
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!DOCTYPE topology SYSTEM \"hwloc2.dtd\">\n<topology version=\"2.0\">\n"
    "<object type=\"Machine\" os_index=\"0\" cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\" allowed_cpuset=\"0x00000001\" "
    "nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" allowed_nodeset=\"0x00000001\" gp_index=\"1\">\n"
    "<object type=\"NUMANode\" os_index=\"0\" cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\" nodeset=\"0x00000001\" "
    "complete_nodeset=\"0x00000001\" gp_index=\"2\" local_memory=\"1073741824\"/>\n"
    "<object type=\"Core\" os_index=\"0\" cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\" nodeset=\"0x00000001\" "
    "complete_nodeset=\"0x00000001\" gp_index=\"3\">\n"
    "<object type=\"PU\" os_index=\"0\" cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\" nodeset=\"0x00000001\" "
    "complete_nodeset=\"0x00000001\" gp_index=\"4\"/>\n</object>\n</object>\n</topology>\n";

int main(void) {
    avgpipe_context ctx;
    avgpipe_hwloc_topo_desc td;
    avgpipe_hwloc_placement_desc pd;
    avgpipe_hwloc_topo *topo = NULL;
    avgpipe_hwloc_placement *plan = NULL;
    const avgpipe_hwloc_place *pl;
    int ok;
    memset(&td, 0, sizeof td);
    memset(&pd, 0, sizeof pd);
    avgpipe_context_init(&ctx, NULL);
    td.xml = xml;
    pd.count = 1;
    if (avgpipe_hwloc_topo_load(&ctx, &td, &topo) != AVGPIPE_OK || avgpipe_hwloc_placement_create(&ctx, topo, &pd, &plan) != AVGPIPE_OK) return 1;
    pl = avgpipe_hwloc_placement_rank(plan, 0);
    ok = pl && !strcmp(pl->worker_cpus, "0") && avgpipe_hwloc_bind_thread(0, AVGPIPE_THREAD_WORKER, plan) != 0;
    avgpipe_hwloc_placement_free(plan);
    avgpipe_hwloc_topo_free(topo);
    return ok && !strcmp(avgpipe_hwloc_nic_distance_name(AVGPIPE_HWLOC_NIC_PIX), "PIX") ? 0 : 1;
}
