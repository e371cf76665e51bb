/* Tests of avgpipe_hwloc.h: placement plans on synthetic topologies loaded from XML (tests/data, written
   by tests/data/topo_gen.py), so that the decisions are checked without the hardware:
     topo_server2s4g.xml  two sockets, one NUMA node each, 8 cores x 2 hyperthreads per socket (core c:
                          cpus c and c+16); PCIe: socket 0 has a switch with GPU 0000:3b:00.0 (cuda1)
                          and InfiniBand NIC 0000:3c:00.0 (mlx5_0, ib0), GPU 0000:5e:00.0 (cuda3) on its
                          own host bridge, Ethernet eno1 (0000:18:00.0) on another; socket 1 has a
                          switch with GPU 0000:b0:00.0 (cuda2) and NIC 0000:b1:00.0 (mlx5_1, ib1), GPU
                          0000:d8:00.0 (cuda0) on its own host bridge. CUDA ordinals are not in bus
                          order, as with CUDA's default fastest-first numbering.
     topo_laptop.xml      one socket, one NUMA node, 4 cores x 2 (core c: cpus 2c, 2c+1); an integrated
                          GPU (card0), a discrete NVIDIA GPU 0000:01:00.0 without a CUDA device, and
                          Wi-Fi wlp2s0 (0000:02:00.0) under the same host bridge.
     topo_small6.xml      six cores in two NUMA nodes of three, no I/O: fewer cores than threads.
   Each test asserts which cores (hwloc logical indexes) and cpus (OS numbers) each rank's worker and
   averaging thread get, their NUMA node and the NIC reported. Then on this machine: binding really
   binds the calling thread (hwloc_get_cpubind), and the runtime calls bind_thread once per thread it
   starts, with the right rank and role, on the thread that then runs that rank's callbacks.

   Tests run with the repository root as working directory. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_hwloc.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/toy_model.h"

TestSuite(hwloc, .timeout = 120);

/* ---- helpers ---------------------------------------------------------------------------------- */

static avgpipe_context g_ctx;

static avgpipe_hwloc_topo *load(const char *name) {
    avgpipe_hwloc_topo_desc d;
    avgpipe_hwloc_topo *t = NULL;
    char path[256];
    avgpipe_result r;
    memset(&d, 0, sizeof d);
    avgpipe_context_init(&g_ctx, NULL);
    if (name) {
        snprintf(path, sizeof path, "tests/data/%s", name);
        d.xml_path = path;
    }
    r = avgpipe_hwloc_topo_load(&g_ctx, &d, &t);
    cr_assert_eq(r, AVGPIPE_OK, "load %s: %s", name ? name : "this machine", avgpipe_last_error(&g_ctx));
    cr_assert(t != NULL);
    return t;
}

static avgpipe_hwloc_placement *plan_full(const avgpipe_hwloc_topo *t, int count, const int *ranks, const char *const *gpus,
                                     avgpipe_hwloc_bind_mode bind, const char *cpus) {
    avgpipe_hwloc_placement_desc d;
    avgpipe_hwloc_placement *p = NULL;
    avgpipe_result r;
    memset(&d, 0, sizeof d);
    d.count = count, d.ranks = ranks, d.gpus = gpus, d.bind = bind, d.cpus = cpus;
    r = avgpipe_hwloc_placement_create(&g_ctx, t, &d, &p);
    cr_assert_eq(r, AVGPIPE_OK, "plan: %s", avgpipe_last_error(&g_ctx));
    return p;
}

static avgpipe_hwloc_placement *plan(const avgpipe_hwloc_topo *t, int count, const char *const *gpus) {
    return plan_full(t, count, NULL, gpus, AVGPIPE_HWLOC_BIND_AUTO, NULL);
}

/* The error a plan description gets; its detail must contain `want`. */
static void plan_fails(const avgpipe_hwloc_topo *t, const avgpipe_hwloc_placement_desc *d, avgpipe_result code, const char *want) {
    avgpipe_hwloc_placement *p = (avgpipe_hwloc_placement *)&g_ctx; /* must be reset to NULL */
    avgpipe_result r = avgpipe_hwloc_placement_create(&g_ctx, t, d, &p);
    cr_assert_eq(r, code, "want %s, got %s: %s", avgpipe_result_string(code), avgpipe_result_string(r), avgpipe_last_error(&g_ctx));
    cr_assert(p == NULL);
    cr_assert(strstr(avgpipe_last_error(&g_ctx), want) != NULL, "detail '%s' lacks '%s'", avgpipe_last_error(&g_ctx), want);
}

/* Rank `rank`'s worker on cores wc (cpus wcpu), averaging on core ac (cpus acpu), on NUMA node numa. */
static const avgpipe_hwloc_place *expect(const avgpipe_hwloc_placement *p, int rank, const char *wc, const char *wcpu, const char *ac,
                                         const char *acpu, int numa) {
    const avgpipe_hwloc_place *pl = avgpipe_hwloc_placement_rank(p, rank);
    cr_assert(pl != NULL, "rank %d is not in the placement", rank);
    cr_assert_eq(pl->rank, rank);
    cr_assert_str_eq(pl->worker_cores, wc, "rank %d: worker cores %s, want %s", rank, pl->worker_cores, wc);
    cr_assert_str_eq(pl->worker_cpus, wcpu, "rank %d: worker cpus %s, want %s", rank, pl->worker_cpus, wcpu);
    cr_assert_str_eq(pl->avg_cores, ac, "rank %d: averaging core %s, want %s", rank, pl->avg_cores, ac);
    cr_assert_str_eq(pl->avg_cpus, acpu, "rank %d: averaging cpus %s, want %s", rank, pl->avg_cpus, acpu);
    cr_assert_eq(pl->numa, numa, "rank %d: numa %d, want %d", rank, pl->numa, numa);
    return pl;
}

static void expect_gpu(const avgpipe_hwloc_place *pl, const char *busid, const char *name, int cuda, int numa) {
    cr_assert_str_eq(pl->gpu, busid, "rank %d: gpu %s, want %s", pl->rank, pl->gpu, busid);
    cr_assert_str_eq(pl->gpu_name, name, "rank %d: gpu name %s, want %s", pl->rank, pl->gpu_name, name);
    cr_assert_eq(pl->cuda, cuda, "rank %d: cuda %d, want %d", pl->rank, pl->cuda, cuda);
    cr_assert_eq(pl->gpu_numa, numa, "rank %d: gpu numa %d, want %d", pl->rank, pl->gpu_numa, numa);
}

static void expect_nic(const avgpipe_hwloc_place *pl, const char *nic, const char *pci, avgpipe_hwloc_nic_distance d) {
    cr_assert_str_eq(pl->nic, nic, "rank %d: nic %s, want %s", pl->rank, pl->nic, nic);
    cr_assert_str_eq(pl->nic_pci, pci, "rank %d: nic at %s, want %s", pl->rank, pl->nic_pci, pci);
    cr_assert_eq(pl->nic_distance, d, "rank %d: nic distance %s, want %s", pl->rank, avgpipe_hwloc_nic_distance_name(pl->nic_distance),
                 avgpipe_hwloc_nic_distance_name(d));
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;
    cr_assert(f != NULL, "%s", path);
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = (char *)malloc((size_t)n + 1);
    cr_assert(buf && fread(buf, 1, (size_t)n, f) == (size_t)n);
    buf[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* ---- topologies ------------------------------------------------------------------------------- */

Test(hwloc, synthetic_topologies_load) {
    static const struct {
        const char *name;
        int packages, numa, cores, pus, pcidevs, osdevs;
    } want[] = {{"topo_server2s4g.xml", 2, 2, 16, 32, 7, 9}, {"topo_laptop.xml", 1, 1, 4, 8, 3, 2}, {"topo_small6.xml", 1, 2, 6, 6, 0, 0}};
    size_t i;
    for (i = 0; i < sizeof want / sizeof want[0]; i++) {
        avgpipe_hwloc_topo *t = load(want[i].name);
        hwloc_topology_t h = avgpipe_hwloc_topo_hwloc(t);
        hwloc_obj_t o = NULL;
        int pci = 0, os = 0;
        while ((o = hwloc_get_next_pcidev(h, o)) != NULL) pci++;
        while ((o = hwloc_get_next_osdev(h, o)) != NULL) os++;
        cr_assert_eq(hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_PACKAGE), want[i].packages, "%s: packages", want[i].name);
        cr_assert_eq(hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_NUMANODE), want[i].numa, "%s: NUMA nodes", want[i].name);
        cr_assert_eq(hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_CORE), want[i].cores, "%s: cores", want[i].name);
        cr_assert_eq(hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_PU), want[i].pus, "%s: PUs", want[i].name);
        cr_assert_eq(pci, want[i].pcidevs, "%s: %d PCI devices", want[i].name, pci);
        cr_assert_eq(os, want[i].osdevs, "%s: %d OS devices", want[i].name, os);
        cr_assert_eq(avgpipe_hwloc_topo_is_this_system(t), 0, "%s: an XML topology is not this machine", want[i].name);
        avgpipe_hwloc_topo_free(t);
    }
}

Test(hwloc, topology_from_memory) {
    size_t len;
    char *xml = read_file("tests/data/topo_server2s4g.xml", &len);
    avgpipe_hwloc_topo_desc d;
    avgpipe_hwloc_topo *t = NULL;
    int k;
    avgpipe_context_init(&g_ctx, NULL);
    for (k = 0; k < 2; k++) { /* with its length, and NUL-terminated with xml_len 0 */
        memset(&d, 0, sizeof d);
        d.xml = xml, d.xml_len = k ? 0 : len;
        cr_assert_eq(avgpipe_hwloc_topo_load(&g_ctx, &d, &t), AVGPIPE_OK, "%s", avgpipe_last_error(&g_ctx));
        cr_assert_eq(hwloc_get_nbobjs_by_type(avgpipe_hwloc_topo_hwloc(t), HWLOC_OBJ_CORE), 16);
        {
            const char *gpus[1] = {"cuda2"};
            avgpipe_hwloc_placement *p = plan(t, 1, gpus);
            expect_gpu(expect(p, 0, "8-14", "8-14,24-30", "15", "15,31", 1), "0000:b0:00.0", "cuda2", 2, 1);
            avgpipe_hwloc_placement_free(p);
        }
        avgpipe_hwloc_topo_free(t);
    }
    free(xml);
}

/* avgpipe_hwloc_topo_query_defaults: xml_len 0 becomes the text's length; nothing else changes. */
Test(hwloc, topology_query_defaults) {
    avgpipe_hwloc_topo_desc d, q;
    memset(&d, 0, sizeof d);
    q = avgpipe_hwloc_topo_query_defaults(&d);
    cr_assert(q.xml == NULL && q.xml_path == NULL && q.xml_len == 0 && q.is_this_system == 0);
    d.xml = "<topology/>";
    cr_assert_eq(avgpipe_hwloc_topo_query_defaults(&d).xml_len, strlen("<topology/>"));
    d.xml_len = 4;
    cr_assert_eq(avgpipe_hwloc_topo_query_defaults(&d).xml_len, 4, "a given length is kept");
    cr_assert_eq(avgpipe_hwloc_topo_query_defaults(NULL).xml_len, 0);
}

Test(hwloc, topology_errors) {
    avgpipe_hwloc_topo_desc d;
    avgpipe_hwloc_topo *t = (avgpipe_hwloc_topo *)&g_ctx;
    static const char junk[] = "<?xml version=\"1.0\"?><topology version=\"2.0\"><object type=\"Machine\" cpuset=";
    avgpipe_context_init(&g_ctx, NULL);
    memset(&d, 0, sizeof d);
    d.xml_path = "tests/data/topo_laptop.xml", d.xml = junk;
    cr_assert_eq(avgpipe_hwloc_topo_load(&g_ctx, &d, &t), AVGPIPE_INVALID_ARG);
    cr_assert(t == NULL);
    memset(&d, 0, sizeof d);
    d.xml_path = "tests/data/no-such-topology.xml";
    cr_assert_eq(avgpipe_hwloc_topo_load(&g_ctx, &d, &t), AVGPIPE_IO_ERROR);
    cr_assert(strstr(avgpipe_last_error(&g_ctx), "no-such-topology.xml") != NULL, "%s", avgpipe_last_error(&g_ctx));
    memset(&d, 0, sizeof d);
    d.xml = junk;
    cr_assert_eq(avgpipe_hwloc_topo_load(&g_ctx, &d, &t), AVGPIPE_PARSE_ERROR, "%s", avgpipe_last_error(&g_ctx));
    cr_assert(t == NULL);
    cr_assert_eq(avgpipe_hwloc_topo_load(&g_ctx, NULL, NULL), AVGPIPE_INVALID_ARG);
}

/* ---- two sockets, four GPUs, two NICs --------------------------------------------------------- */

/* GPUs as CUDA ordinals, found through the topology's cudaN OS devices (not in bus order): the two GPUs
   of a socket share its 8 cores, 3 + 1 each, and each GPU's nearest NIC is its socket's InfiniBand
   NIC, behind the same switch (PIX) or on the same NUMA node (NODE), never eno1 (an RDMA NIC first). */
Test(hwloc, server_cuda_ordinals) {
    avgpipe_hwloc_topo *t = load("topo_server2s4g.xml");
    const char *gpus[4] = {"0", "1", "cuda2", "cuda:3"};
    avgpipe_hwloc_placement *p = plan(t, 4, gpus);
    avgpipe_hwloc_placement_info in = avgpipe_hwloc_placement_query(p);
    const avgpipe_hwloc_place *pl;
    pl = expect(p, 0, "8-10", "8-10,24-26", "11", "11,27", 1);
    expect_gpu(pl, "0000:d8:00.0", "cuda0", 0, 1);
    expect_nic(pl, "mlx5_1,ib1", "0000:b1:00.0", AVGPIPE_HWLOC_NIC_NODE);
    pl = expect(p, 1, "0-2", "0-2,16-18", "3", "3,19", 0);
    expect_gpu(pl, "0000:3b:00.0", "cuda1", 1, 0);
    expect_nic(pl, "mlx5_0,ib0", "0000:3c:00.0", AVGPIPE_HWLOC_NIC_PIX);
    pl = expect(p, 2, "12-14", "12-14,28-30", "15", "15,31", 1);
    expect_gpu(pl, "0000:b0:00.0", "cuda2", 2, 1);
    expect_nic(pl, "mlx5_1,ib1", "0000:b1:00.0", AVGPIPE_HWLOC_NIC_PIX);
    pl = expect(p, 3, "4-6", "4-6,20-22", "7", "7,23", 0);
    expect_gpu(pl, "0000:5e:00.0", "cuda3", 3, 0);
    expect_nic(pl, "mlx5_0,ib0", "0000:3c:00.0", AVGPIPE_HWLOC_NIC_NODE);
    cr_assert(!pl->worker_shared && !pl->avg_shared && !pl->note[0]);
    cr_assert_eq(in.count, 4);
    cr_assert_eq(in.cores, 16);
    cr_assert_eq(in.numa_nodes, 2);
    cr_assert_eq(in.exclusive, 1);
    cr_assert_eq(in.binds, 1);
    cr_assert_eq(in.this_system, 0);
    cr_assert_str_eq(in.cpus, "0-31");
    cr_assert_str_eq(in.machine, "server2s4g");
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* GPUs as PCI bus ids (the short form too), for global ranks 8..11 (this machine's share of a job). */
Test(hwloc, server_pci_bus_ids_and_global_ranks) {
    avgpipe_hwloc_topo *t = load("topo_server2s4g.xml");
    const char *gpus[4] = {"0000:3b:00.0", "5e:00.0", "0000:B0:00.0", "0000:d8:00.0"};
    const int ranks[4] = {8, 9, 10, 11};
    avgpipe_hwloc_placement *p = plan_full(t, 4, ranks, gpus, AVGPIPE_HWLOC_BIND_AUTO, NULL);
    expect_nic(expect(p, 8, "0-2", "0-2,16-18", "3", "3,19", 0), "mlx5_0,ib0", "0000:3c:00.0", AVGPIPE_HWLOC_NIC_PIX);
    expect_gpu(expect(p, 9, "4-6", "4-6,20-22", "7", "7,23", 0), "0000:5e:00.0", "cuda3", 3, 0);
    expect_gpu(expect(p, 10, "8-10", "8-10,24-26", "11", "11,27", 1), "0000:b0:00.0", "cuda2", 2, 1);
    expect_nic(expect(p, 11, "12-14", "12-14,28-30", "15", "15,31", 1), "mlx5_1,ib1", "0000:b1:00.0", AVGPIPE_HWLOC_NIC_NODE);
    cr_assert(avgpipe_hwloc_placement_rank(p, 0) == NULL, "rank 0 was not planned");
    cr_assert(avgpipe_hwloc_placement_rank(p, 12) == NULL);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* Two ranks per GPU: the four ranks of a socket share its 8 cores, two each (one for the worker, one for
   the averaging thread). */
Test(hwloc, server_two_ranks_per_gpu) {
    avgpipe_hwloc_topo *t = load("topo_server2s4g.xml");
    const char *gpus[8] = {"0000:3b:00.0", "0000:3b:00.0", "0000:5e:00.0", "0000:5e:00.0",
                           "0000:b0:00.0", "0000:b0:00.0", "0000:d8:00.0", "0000:d8:00.0"};
    avgpipe_hwloc_placement *p = plan(t, 8, gpus);
    int r;
    char wc[16], wcpu[32], ac[16], acpu[32];
    for (r = 0; r < 8; r++) {
        snprintf(wc, sizeof wc, "%d", 2 * r);
        snprintf(wcpu, sizeof wcpu, "%d,%d", 2 * r, 2 * r + 16);
        snprintf(ac, sizeof ac, "%d", 2 * r + 1);
        snprintf(acpu, sizeof acpu, "%d,%d", 2 * r + 1, 2 * r + 17);
        expect(p, r, wc, wcpu, ac, acpu, r / 4);
    }
    cr_assert_eq(avgpipe_hwloc_placement_query(p).exclusive, 1);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* Five ranks on one GPU (8 cores near it): a core per worker, the three spare cores for the five
   averaging threads (ranks 0, 1 -> core 5; 2, 3 -> 6; 4 -> 7). Still exclusive: binding on. */
Test(hwloc, server_five_ranks_on_one_gpu) {
    avgpipe_hwloc_topo *t = load("topo_server2s4g.xml");
    const char *gpus[5] = {"cuda1", "cuda1", "cuda1", "cuda1", "cuda1"};
    avgpipe_hwloc_placement *p = plan(t, 5, gpus);
    static const char *const avg[5] = {"5", "5", "6", "6", "7"}, *const avgcpu[5] = {"5,21", "5,21", "6,22", "6,22", "7,23"};
    int r;
    for (r = 0; r < 5; r++) {
        char wc[16], wcpu[32];
        const avgpipe_hwloc_place *pl;
        snprintf(wc, sizeof wc, "%d", r);
        snprintf(wcpu, sizeof wcpu, "%d,%d", r, r + 16);
        pl = expect(p, r, wc, wcpu, avg[r], avgcpu[r], 0);
        cr_assert_eq(pl->worker_shared, 0);
        cr_assert_eq(pl->avg_shared, r < 4, "rank %d: averaging core shared %d", r, pl->avg_shared);
    }
    cr_assert_eq(avgpipe_hwloc_placement_query(p).exclusive, 1);
    cr_assert_eq(avgpipe_hwloc_placement_query(p).binds, 1);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* Ten ranks on one GPU's 8 cores: workers share (floor(i * 8 / 10)), the averaging thread with its
   worker; auto binding then stays off, always binds, none never does. */
Test(hwloc, server_more_ranks_than_cores_near_the_gpu) {
    avgpipe_hwloc_topo *t = load("topo_server2s4g.xml");
    const char *gpus[10];
    static const int core[10] = {0, 0, 1, 2, 3, 4, 4, 5, 6, 7};
    avgpipe_hwloc_bind_mode modes[3] = {AVGPIPE_HWLOC_BIND_AUTO, AVGPIPE_HWLOC_BIND_ALWAYS, AVGPIPE_HWLOC_BIND_NONE};
    int r, m;
    for (r = 0; r < 10; r++) gpus[r] = "0000:3b:00.0";
    for (m = 0; m < 3; m++) {
        avgpipe_hwloc_placement *p = plan_full(t, 10, NULL, gpus, modes[m], NULL);
        avgpipe_hwloc_placement_info in = avgpipe_hwloc_placement_query(p);
        for (r = 0; r < 10; r++) {
            char c[16], cpu[32];
            const avgpipe_hwloc_place *pl;
            snprintf(c, sizeof c, "%d", core[r]);
            snprintf(cpu, sizeof cpu, "%d,%d", core[r], core[r] + 16);
            pl = expect(p, r, c, cpu, c, cpu, 0);
            cr_assert_eq(pl->worker_shared, core[r] == 0 || core[r] == 4, "rank %d: worker shared %d", r, pl->worker_shared);
            cr_assert_eq(pl->avg_shared, 1);
        }
        cr_assert_eq(in.exclusive, 0);
        cr_assert_eq(in.binds, modes[m] == AVGPIPE_HWLOC_BIND_ALWAYS, "mode %d binds %d", (int)modes[m], in.binds);
        if (modes[m] == AVGPIPE_HWLOC_BIND_AUTO) { /* report only: binding it on a foreign topology does nothing */
            cr_assert_eq(avgpipe_hwloc_bind(&g_ctx, p, 0, AVGPIPE_THREAD_WORKER), AVGPIPE_OK);
        }
        avgpipe_hwloc_placement_free(p);
    }
    avgpipe_hwloc_topo_free(t);
}

/* CPU ranks spread over the sockets in proportion to their cores, each rank inside one NUMA node; a
   CPU rank's NIC is the one on its NUMA node. */
Test(hwloc, server_cpu_ranks) {
    avgpipe_hwloc_topo *t = load("topo_server2s4g.xml");
    avgpipe_hwloc_placement *p = plan(t, 4, NULL);
    expect_nic(expect(p, 0, "0-2", "0-2,16-18", "3", "3,19", 0), "mlx5_0,ib0", "0000:3c:00.0", AVGPIPE_HWLOC_NIC_NODE);
    expect(p, 1, "4-6", "4-6,20-22", "7", "7,23", 0);
    expect(p, 2, "8-10", "8-10,24-26", "11", "11,27", 1);
    expect_nic(expect(p, 3, "12-14", "12-14,28-30", "15", "15,31", 1), "mlx5_1,ib1", "0000:b1:00.0", AVGPIPE_HWLOC_NIC_NODE);
    cr_assert_str_eq(avgpipe_hwloc_placement_rank(p, 0)->gpu, "");
    cr_assert_eq(avgpipe_hwloc_placement_rank(p, 0)->gpu_numa, -1);
    avgpipe_hwloc_placement_free(p);
    p = plan(t, 3, NULL); /* 1.5 ranks per socket: two on the first, the third alone on the second */
    expect(p, 0, "0-2", "0-2,16-18", "3", "3,19", 0);
    expect(p, 1, "4-6", "4-6,20-22", "7", "7,23", 0);
    expect(p, 2, "8-14", "8-14,24-30", "15", "15,31", 1);
    avgpipe_hwloc_placement_free(p);
    p = plan(t, 1, NULL); /* one rank stays on one NUMA node */
    expect(p, 0, "0-6", "0-6,16-22", "7", "7,23", 0);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* desc.cpus narrows the placement (here to the first hyperthread of socket 0's cores); a GPU whose cores
   are all outside gets cores anyway, with a note. */
Test(hwloc, server_cpus_restriction) {
    avgpipe_hwloc_topo *t = load("topo_server2s4g.xml");
    const char *gpus[1] = {"0000:b0:00.0"};
    avgpipe_hwloc_placement *p = plan_full(t, 2, NULL, NULL, AVGPIPE_HWLOC_BIND_AUTO, "0-7");
    const avgpipe_hwloc_place *pl;
    expect(p, 0, "0-2", "0-2", "3", "3", 0);
    expect(p, 1, "4-6", "4-6", "7", "7", 0);
    cr_assert_eq(avgpipe_hwloc_placement_query(p).cores, 8);
    cr_assert_str_eq(avgpipe_hwloc_placement_query(p).cpus, "0-7");
    avgpipe_hwloc_placement_free(p);
    p = plan_full(t, 1, NULL, gpus, AVGPIPE_HWLOC_BIND_AUTO, "0-7");
    pl = expect(p, 0, "0-6", "0-6", "7", "7", 0);
    cr_assert_eq(pl->gpu_numa, 1);
    cr_assert(strstr(pl->note, "outside the cpus planned over") != NULL, "note: %s", pl->note);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* GPU and CPU ranks in one plan: the GPU rank takes its socket, the CPU ranks share what is left. */
Test(hwloc, server_gpu_and_cpu_ranks) {
    avgpipe_hwloc_topo *t = load("topo_server2s4g.xml");
    const char *gpus[3] = {"0000:3b:00.0", NULL, ""};
    avgpipe_hwloc_placement *p = plan(t, 3, gpus);
    expect(p, 0, "0-6", "0-6,16-22", "7", "7,23", 0);
    expect(p, 1, "8-10", "8-10,24-26", "11", "11,27", 1);
    expect(p, 2, "12-14", "12-14,28-30", "15", "15,31", 1);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* The report, line by line. */
Test(hwloc, server_report) {
    avgpipe_hwloc_topo *t = load("topo_server2s4g.xml");
    const char *gpus[4] = {"0", "1", "2", "3"};
    avgpipe_hwloc_placement *p = plan(t, 4, gpus);
    avgpipe_buf b = {0};
    static const char want[] =
        "hwloc placement on server2s4g (from XML): 2 packages, 2 NUMA nodes, 16 cores, 32 PUs; 4 ranks over 16 cores (cpus 0-31)\n"
        "binding: auto -> on: every worker has cores of its own\n"
        "rank 0: gpu 0000:d8:00.0 cuda0 (numa 1); worker cores 8-10 (cpus 8-10,24-26), averaging core 11 (cpus 11,27), numa 1; "
        "nic mlx5_1,ib1 0000:b1:00.0 (NODE: same NUMA node)\n"
        "rank 1: gpu 0000:3b:00.0 cuda1 (numa 0); worker cores 0-2 (cpus 0-2,16-18), averaging core 3 (cpus 3,19), numa 0; "
        "nic mlx5_0,ib0 0000:3c:00.0 (PIX: same PCIe bridge)\n"
        "rank 2: gpu 0000:b0:00.0 cuda2 (numa 1); worker cores 12-14 (cpus 12-14,28-30), averaging core 15 (cpus 15,31), numa 1; "
        "nic mlx5_1,ib1 0000:b1:00.0 (PIX: same PCIe bridge)\n"
        "rank 3: gpu 0000:5e:00.0 cuda3 (numa 0); worker cores 4-6 (cpus 4-6,20-22), averaging core 7 (cpus 7,23), numa 0; "
        "nic mlx5_0,ib0 0000:3c:00.0 (NODE: same NUMA node)\n"
        "NICs are diagnostic: NCCL and MPI choose their own.\n";
    cr_assert_eq(avgpipe_hwloc_placement_report(&g_ctx, p, &b), AVGPIPE_OK);
    cr_assert_str_eq(b.data, want, "report:\n%s", b.data);
    avgpipe_buf_free(&g_ctx, &b);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* ---- a laptop --------------------------------------------------------------------------------- */

/* The discrete GPU, by bus id (no CUDA device in this topology): the whole socket (3 + 1 cores), the
   Wi-Fi under the same host bridge (PHB); the integrated GPU is named by its OS device. */
Test(hwloc, laptop_gpu) {
    avgpipe_hwloc_topo *t = load("topo_laptop.xml");
    const char *gpus[1] = {"0000:01:00.0"}, *igpu[1] = {"00:02.0"};
    avgpipe_hwloc_placement *p = plan(t, 1, gpus);
    const avgpipe_hwloc_place *pl = expect(p, 0, "0-2", "0-5", "3", "6-7", 0);
    expect_gpu(pl, "0000:01:00.0", "", -1, 0);
    expect_nic(pl, "wlp2s0", "0000:02:00.0", AVGPIPE_HWLOC_NIC_PHB);
    avgpipe_hwloc_placement_free(p);
    p = plan(t, 1, igpu);
    expect_gpu(avgpipe_hwloc_placement_rank(p, 0), "0000:00:02.0", "card0", -1, 0);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

Test(hwloc, laptop_cpu_ranks) {
    avgpipe_hwloc_topo *t = load("topo_laptop.xml");
    avgpipe_hwloc_placement *p = plan(t, 2, NULL);
    int r;
    expect_nic(expect(p, 0, "0", "0-1", "1", "2-3", 0), "wlp2s0", "0000:02:00.0", AVGPIPE_HWLOC_NIC_NODE);
    expect(p, 1, "2", "4-5", "3", "6-7", 0);
    avgpipe_hwloc_placement_free(p);
    p = plan(t, 4, NULL); /* a core per worker, no spare: the averaging thread shares its worker's core */
    for (r = 0; r < 4; r++) {
        char c[16], cpu[32];
        const avgpipe_hwloc_place *pl;
        snprintf(c, sizeof c, "%d", r);
        snprintf(cpu, sizeof cpu, "%d-%d", 2 * r, 2 * r + 1);
        pl = expect(p, r, c, cpu, c, cpu, 0);
        cr_assert(!pl->worker_shared && pl->avg_shared);
    }
    cr_assert_eq(avgpipe_hwloc_placement_query(p).exclusive, 1);
    cr_assert_eq(avgpipe_hwloc_placement_query(p).binds, 1);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

Test(hwloc, bad_plan_descriptions) {
    avgpipe_hwloc_topo *t = load("topo_laptop.xml");
    avgpipe_hwloc_placement_desc d;
    const char *ordinal[1] = {"0"}, *nobus[1] = {"0000:99:00.0"}, *junk[2] = {NULL, "0x01:00.0"};
    const int dup[2] = {3, 3}, neg[1] = {-2};
    memset(&d, 0, sizeof d);
    plan_fails(t, &d, AVGPIPE_INVALID_ARG, "count is 0");
    d.count = 1, d.gpus = ordinal;
    plan_fails(t, &d, AVGPIPE_INVALID_ARG, "no CUDA device cuda0");
    d.gpus = nobus;
    plan_fails(t, &d, AVGPIPE_INVALID_ARG, "no PCI device 0000:99:00.0");
    d.count = 2, d.gpus = junk;
    plan_fails(t, &d, AVGPIPE_INVALID_ARG, "rank 1: gpus[1] = \"0x01:00.0\" is neither");
    d.gpus = NULL, d.ranks = dup;
    plan_fails(t, &d, AVGPIPE_INVALID_ARG, "rank 3 is planned twice");
    d.count = 1, d.ranks = neg;
    plan_fails(t, &d, AVGPIPE_INVALID_ARG, "ranks[0] is -2");
    d.ranks = NULL, d.cpus = "64-71";
    plan_fails(t, &d, AVGPIPE_INVALID_ARG, "cpus \"64-71\"");
    d.cpus = "one,two";
    plan_fails(t, &d, AVGPIPE_INVALID_ARG, "cpus \"one,two\"");
    d.cpus = NULL, d.bind = (avgpipe_hwloc_bind_mode)7;
    plan_fails(t, &d, AVGPIPE_INVALID_ARG, "bind is 7");
    avgpipe_hwloc_topo_free(t);
}

/* ---- fewer cores than threads ----------------------------------------------------------------- */

Test(hwloc, small_machine_scarce_cores) {
    avgpipe_hwloc_topo *t = load("topo_small6.xml");
    avgpipe_hwloc_placement *p = plan(t, 4, NULL);
    static const int w7[7] = {0, 0, 1, 2, 3, 4, 5};
    int r;
    /* 8 threads, 6 cores: two ranks per NUMA node, a core per worker, the node's third core for both
       averaging threads */
    expect(p, 0, "0", "0", "2", "2", 0);
    expect(p, 1, "1", "1", "2", "2", 0);
    expect(p, 2, "3", "3", "5", "5", 1);
    expect_nic(expect(p, 3, "4", "4", "5", "5", 1), "", "", AVGPIPE_HWLOC_NIC_NONE);
    cr_assert_eq(avgpipe_hwloc_placement_query(p).binds, 1);
    avgpipe_hwloc_placement_free(p);
    p = plan(t, 3, NULL);
    expect(p, 0, "0", "0", "2", "2", 0);
    expect(p, 1, "1", "1", "2", "2", 0);
    expect(p, 2, "3-4", "3-4", "5", "5", 1);
    avgpipe_hwloc_placement_free(p);
    p = plan(t, 6, NULL);
    for (r = 0; r < 6; r++) {
        char c[16];
        snprintf(c, sizeof c, "%d", r);
        expect(p, r, c, c, c, c, r / 3);
    }
    cr_assert_eq(avgpipe_hwloc_placement_query(p).binds, 1);
    avgpipe_hwloc_placement_free(p);
    p = plan(t, 7, NULL); /* more workers than cores: they share, auto leaves the threads unbound */
    for (r = 0; r < 7; r++) {
        char c[16];
        snprintf(c, sizeof c, "%d", w7[r]);
        cr_assert_eq(expect(p, r, c, c, c, c, w7[r] / 3)->worker_shared, r < 2);
    }
    cr_assert_eq(avgpipe_hwloc_placement_query(p).exclusive, 0);
    cr_assert_eq(avgpipe_hwloc_placement_query(p).binds, 0);
    {
        avgpipe_buf b = {0};
        cr_assert_eq(avgpipe_hwloc_placement_report(&g_ctx, p, &b), AVGPIPE_OK);
        cr_assert(strstr(b.data, "binding: auto -> off: workers would share cores") != NULL, "%s", b.data);
        cr_assert(strstr(b.data, "rank 0: cpu; worker core 0 (cpus 0) shared, averaging core 0 (cpus 0) shared, numa 0; nic none\n") != NULL,
                  "%s", b.data);
        avgpipe_buf_free(&g_ctx, &b);
    }
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* ---- binding on this machine ------------------------------------------------------------------ */

/* The calling thread's binding equals the placement's set for (rank, role). */
static void assert_bound(avgpipe_hwloc_topo *t, const avgpipe_hwloc_placement *p, int rank, int role, int flags) {
    hwloc_topology_t h = avgpipe_hwloc_topo_hwloc(t);
    hwloc_bitmap_t want = hwloc_bitmap_alloc(), got = hwloc_bitmap_alloc();
    char ws[128], gs[128];
    cr_assert_eq(avgpipe_hwloc_placement_cpuset(&g_ctx, p, rank, role, want), AVGPIPE_OK, "%s", avgpipe_last_error(&g_ctx));
    cr_assert_eq(hwloc_get_cpubind(h, got, flags), 0);
    hwloc_bitmap_list_snprintf(ws, sizeof ws, want);
    hwloc_bitmap_list_snprintf(gs, sizeof gs, got);
    cr_assert(hwloc_bitmap_isequal(want, got), "rank %d role %d: bound to %s, planned %s", rank, role, gs, ws);
    hwloc_bitmap_free(want);
    hwloc_bitmap_free(got);
}

Test(hwloc, bind_thread_binds_the_calling_thread) {
    avgpipe_hwloc_topo *t = load(NULL);
    avgpipe_hwloc_placement *p = plan_full(t, 1, NULL, NULL, AVGPIPE_HWLOC_BIND_ALWAYS, NULL);
    const avgpipe_hwloc_place *pl = avgpipe_hwloc_placement_rank(p, 0);
    cr_assert_eq(avgpipe_hwloc_topo_is_this_system(t), 1);
    cr_assert(pl && pl->worker_cpus[0] && pl->avg_cpus[0]);
    cr_assert_eq(avgpipe_hwloc_bind_thread(0, AVGPIPE_THREAD_WORKER, p), 0, "%s", avgpipe_last_error(NULL));
    assert_bound(t, p, 0, AVGPIPE_THREAD_WORKER, HWLOC_CPUBIND_THREAD);
    cr_assert_eq(avgpipe_hwloc_bind_thread(0, AVGPIPE_THREAD_AVERAGING, p), 0, "%s", avgpipe_last_error(NULL));
    assert_bound(t, p, 0, AVGPIPE_THREAD_AVERAGING, HWLOC_CPUBIND_THREAD);
    cr_assert_eq(avgpipe_hwloc_bind(&g_ctx, p, 0, AVGPIPE_HWLOC_ROLE_RANK), AVGPIPE_OK, "%s", avgpipe_last_error(&g_ctx));
    assert_bound(t, p, 0, AVGPIPE_HWLOC_ROLE_RANK, HWLOC_CPUBIND_THREAD);
    cr_assert_eq(avgpipe_hwloc_bind_process(&g_ctx, p, 0), AVGPIPE_OK, "%s", avgpipe_last_error(&g_ctx));
    assert_bound(t, p, 0, AVGPIPE_HWLOC_ROLE_RANK, HWLOC_CPUBIND_PROCESS);
    /* errors */
    cr_assert_eq(avgpipe_hwloc_bind_thread(5, AVGPIPE_THREAD_WORKER, p), (int)AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(NULL), "rank 5 is not in the placement") != NULL, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_hwloc_bind(&g_ctx, p, 0, 7), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_hwloc_bind_thread(0, AVGPIPE_THREAD_WORKER, NULL), (int)AVGPIPE_INVALID_ARG);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* Mode none: the callback succeeds and the thread keeps its binding. */
Test(hwloc, bind_none_changes_nothing) {
    avgpipe_hwloc_topo *t = load(NULL);
    hwloc_topology_t h = avgpipe_hwloc_topo_hwloc(t);
    hwloc_bitmap_t before = hwloc_bitmap_alloc(), after = hwloc_bitmap_alloc();
    avgpipe_hwloc_placement *p = plan_full(t, 1, NULL, NULL, AVGPIPE_HWLOC_BIND_NONE, NULL);
    cr_assert_eq(avgpipe_hwloc_placement_query(p).binds, 0);
    cr_assert_eq(hwloc_get_cpubind(h, before, HWLOC_CPUBIND_THREAD), 0);
    cr_assert_eq(avgpipe_hwloc_bind_thread(0, AVGPIPE_THREAD_AVERAGING, p), 0);
    cr_assert_eq(avgpipe_hwloc_bind_process(&g_ctx, p, 0), AVGPIPE_OK);
    cr_assert_eq(hwloc_get_cpubind(h, after, HWLOC_CPUBIND_THREAD), 0);
    cr_assert(hwloc_bitmap_isequal(before, after));
    hwloc_bitmap_free(before);
    hwloc_bitmap_free(after);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* A plan of another machine cannot bind this one. */
Test(hwloc, bind_refuses_a_foreign_topology) {
    avgpipe_hwloc_topo *t = load("topo_laptop.xml");
    avgpipe_hwloc_placement *p = plan(t, 2, NULL);
    cr_assert_eq(avgpipe_hwloc_placement_query(p).binds, 1);
    cr_assert_eq(avgpipe_hwloc_bind(&g_ctx, p, 1, AVGPIPE_THREAD_WORKER), AVGPIPE_UNSUPPORTED);
    cr_assert(strstr(avgpipe_last_error(&g_ctx), "not this machine's") != NULL, "%s", avgpipe_last_error(&g_ctx));
    cr_assert_eq(avgpipe_hwloc_bind_thread(0, AVGPIPE_THREAD_AVERAGING, p), (int)AVGPIPE_UNSUPPORTED);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* ---- the runtime calls bind_thread ------------------------------------------------------------ */

#define RANKS 4
/* What the recording bind_thread saw, per (rank, role). */
static struct {
    pthread_mutex_t mu;
    const avgpipe_hwloc_placement *plan;
    avgpipe_hwloc_topo *topo;
    int calls[RANKS][2], bound_ok[RANKS][2], rc[RANKS][2];
    pthread_t tid[RANKS][2];
    int wrong_thread, wrong_binding; /* seen by the callbacks */
} B = {PTHREAD_MUTEX_INITIALIZER, NULL, NULL, {{0}}, {{0}}, {{0}}, {{0}}, 0, 0};

static int thread_bound_as(int rank, int role) {
    hwloc_bitmap_t want = hwloc_bitmap_alloc(), got = hwloc_bitmap_alloc();
    int ok = avgpipe_hwloc_placement_cpuset(NULL, B.plan, rank, role, want) == AVGPIPE_OK &&
             hwloc_get_cpubind(avgpipe_hwloc_topo_hwloc(B.topo), got, HWLOC_CPUBIND_THREAD) == 0 && hwloc_bitmap_isequal(want, got);
    hwloc_bitmap_free(want);
    hwloc_bitmap_free(got);
    return ok;
}

static int record_bind(int rank, int role, void *user) {
    int rc = avgpipe_hwloc_bind_thread(rank, role, user), ok = rc == 0 && thread_bound_as(rank, role);
    pthread_mutex_lock(&B.mu);
    if (rank >= 0 && rank < RANKS && (role == AVGPIPE_THREAD_WORKER || role == AVGPIPE_THREAD_AVERAGING)) {
        B.calls[rank][role]++;
        B.tid[rank][role] = pthread_self();
        B.bound_ok[rank][role] = ok;
        B.rc[rank][role] = rc;
    }
    pthread_mutex_unlock(&B.mu);
    return rc;
}

/* The forward callback: on the worker that bind_thread saw for this rank, bound as planned. */
static int checking_forward(avgpipe_op_ctx *op) {
    int same;
    pthread_mutex_lock(&B.mu);
    same = B.calls[op->rank][AVGPIPE_THREAD_WORKER] == 1 && pthread_equal(B.tid[op->rank][AVGPIPE_THREAD_WORKER], pthread_self());
    pthread_mutex_unlock(&B.mu);
    if (!same) __atomic_store_n(&B.wrong_thread, 1, __ATOMIC_SEQ_CST);
    if (B.plan && avgpipe_hwloc_placement_query(B.plan).binds && avgpipe_hwloc_topo_is_this_system(B.topo) &&
        !thread_bound_as(op->rank, AVGPIPE_THREAD_WORKER))
        __atomic_store_n(&B.wrong_binding, 1, __ATOMIC_SEQ_CST);
    return cb_forward(op);
}

typedef struct logged {
    pthread_mutex_t mu;
    int warnings;
    char first[512];
} logged;

static void log_warn(avgpipe_log_level level, const char *msg, void *user) {
    logged *l = (logged *)user;
    pthread_mutex_lock(&l->mu);
    if (level == AVGPIPE_LOG_WARN && strstr(msg, "binding its")) {
        if (!l->warnings++) snprintf(l->first, sizeof l->first, "%s", msg);
    }
    pthread_mutex_unlock(&l->mu);
}

/* A small run (1F1B, 2 stages, 2 pipelines, 2 replica groups: 4 ranks, 8 threads) for two iterations,
   with bind_thread recording its calls and binding per `p`. */
static void run_with_binding(avgpipe_hwloc_topo *t, const avgpipe_hwloc_placement *p, logged *lg) {
    avgpipe_context ctx;
    avgpipe_context_desc cd;
    avgpipe_run *run = NULL;
    avgpipe_result res;
    setup s;
    int it, g;
    memset(&cd, 0, sizeof cd);
    cd.log = log_warn, cd.log_user = lg;
    avgpipe_context_init(&ctx, &cd);
    B.plan = p, B.topo = t;
    reset_state_d(2, 4, 2, 2);
    setup_init_d(&s, 2, 2, 2, 2);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B, s.d.sched.stages = 2, s.d.sched.micro = 4, s.d.sched.pipes = 2, s.d.sched.rounds = 2;
    s.d.averaging.alpha = 0.3f;
    s.d.cb.forward = checking_forward;
    s.d.bind_thread = record_bind;
    s.d.bind_user = (void *)p;
    res = avgpipe_run_create(&ctx, &s.d, &run);
    cr_assert_eq(res, AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (g = 0; g < 2; g++) T.nslots[g] = avgpipe_run_slots(run, g);
    for (it = 0; it < 2; it++) {
        res = avgpipe_run_iteration(run, NULL);
        cr_assert_eq(res, AVGPIPE_OK, "iteration %d: %s", it, avgpipe_last_error(&ctx));
    }
    avgpipe_run_destroy(run);
    for (g = 0; g < 2; g++) cr_assert(!T.err[g][0], "stage %d: %s", g, T.err[g]);
    cr_assert_eq(T.nf[0][0], 2 * 2 * 4, "pipeline 0 of group 0 ran %ld forwards on stage 0", T.nf[0][0]);
}

/* Once per thread, with its rank and role, before any callback of that rank; every thread its own; the
   callbacks run on the worker thread that was bound, and each thread is bound as planned. */
Test(hwloc, runtime_calls_bind_thread_once_per_thread) {
    avgpipe_hwloc_topo *t = load(NULL);
    avgpipe_hwloc_placement *p = plan_full(t, RANKS, NULL, NULL, AVGPIPE_HWLOC_BIND_ALWAYS, NULL);
    logged lg = {PTHREAD_MUTEX_INITIALIZER, 0, ""};
    int r, role, r2, role2;
    run_with_binding(t, p, &lg);
    for (r = 0; r < RANKS; r++)
        for (role = 0; role < 2; role++) {
            cr_assert_eq(B.calls[r][role], 1, "rank %d, %s thread: bind_thread called %d times", r, role ? "averaging" : "worker",
                         B.calls[r][role]);
            cr_assert_eq(B.rc[r][role], 0, "rank %d role %d: %d", r, role, B.rc[r][role]);
            cr_assert(B.bound_ok[r][role], "rank %d, %s thread: not bound as planned", r, role ? "averaging" : "worker");
            for (r2 = 0; r2 < RANKS; r2++)
                for (role2 = 0; role2 < 2; role2++)
                    if (r2 != r || role2 != role)
                        cr_assert(!pthread_equal(B.tid[r][role], B.tid[r2][role2]), "(%d, %d) and (%d, %d) on one thread", r, role, r2,
                                  role2);
        }
    cr_assert_eq(B.wrong_thread, 0, "a forward ran on another thread than its rank's bound worker");
    cr_assert_eq(B.wrong_binding, 0, "a forward ran on a worker not bound as planned");
    cr_assert_eq(lg.warnings, 0, "%s", lg.first);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}

/* A bind_thread that fails (a plan of another machine) is a warning: the run goes on, unbound. */
Test(hwloc, runtime_runs_on_when_binding_fails) {
    avgpipe_hwloc_topo *t = load("topo_laptop.xml");
    avgpipe_hwloc_placement *p = plan(t, RANKS, NULL);
    logged lg = {PTHREAD_MUTEX_INITIALIZER, 0, ""};
    int r, role;
    run_with_binding(t, p, &lg);
    for (r = 0; r < RANKS; r++)
        for (role = 0; role < 2; role++) {
            cr_assert_eq(B.calls[r][role], 1);
            cr_assert_eq(B.rc[r][role], (int)AVGPIPE_UNSUPPORTED);
        }
    cr_assert_eq(lg.warnings, 2 * RANKS, "%d warnings", lg.warnings);
    cr_assert(strstr(lg.first, "runs unbound") != NULL, "%s", lg.first);
    cr_assert_eq(B.wrong_thread, 0);
    avgpipe_hwloc_placement_free(p);
    avgpipe_hwloc_topo_free(t);
}
