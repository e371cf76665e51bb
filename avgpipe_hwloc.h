/* avgpipe_hwloc.h — hwloc placement for avgpipe.h: which cores each rank's threads run on, near its GPU.

   WHAT IT DECIDES
   ---------------
   A run starts two threads per local rank: the worker, which walks the rank's op list and calls your
   stage callbacks (on a GPU: enqueues kernels, posts NCCL calls), and the averaging thread (elastic
   averaging, once per pipeline and round). From the machine's topology (hwloc 2.x; this machine's, or
   one loaded from XML to test or to plan for another machine) this header computes a placement for
   the ranks that run on one machine:
     - which cores each rank's worker and averaging thread get (distinct cores where there are enough);
     - for a GPU rank, the NUMA node nearest its GPU, and cores there;
     - the network interface nearest each GPU (or each CPU rank's NUMA node), for diagnosis only;
   and prints it as a report. A bind_thread callback for avgpipe_run_desc (and avgpipe_hwloc_bind for
   your own threads or the whole process) applies it with hwloc_set_cpubind.

   QUICK START (every rank a thread of one process)
   -----------
       #define AVGPIPE_IMPLEMENTATION          // in one .c file: the implementations of both headers
       #include "avgpipe.h"
       #include "avgpipe_hwloc.h"              // after avgpipe.h; needs <hwloc.h>: -lhwloc (pkg-config hwloc)

       avgpipe_hwloc_topo *topo;                          // this machine (desc NULL), with its PCI devices
       avgpipe_hwloc_placement *placement;
       avgpipe_hwloc_placement_desc pd = {0};
       const char *gpus[4] = {"0", "1", "2", "3"};        // rank r on CUDA device r; or PCI bus ids
       pd.count = 4; pd.gpus = gpus;                      // gpus NULL: CPU ranks
       if (avgpipe_hwloc_topo_load(&ctx, NULL, &topo) || avgpipe_hwloc_placement_create(&ctx, topo, &pd, &placement))
           fprintf(stderr, "placement: %s\n", avgpipe_last_error(&ctx));      // train unbound
       else {
           avgpipe_buf rep = {0};
           if (!avgpipe_hwloc_placement_report(&ctx, placement, &rep)) fputs(rep.data, stderr);
           avgpipe_buf_free(&ctx, &rep);
           desc.bind_thread = avgpipe_hwloc_bind_thread;   // avgpipe_run_desc
           desc.bind_user = placement;
       }
       ... avgpipe_run_create / iterations / avgpipe_run_destroy ...
       avgpipe_hwloc_placement_free(placement);                     // after the run; then the topology
       avgpipe_hwloc_topo_free(topo);

   THE POLICY
   ----------
   Cores. The placement puts threads on cores (all the hardware threads of a core: a thread bound to core
   3 of a machine with hyperthreads may run on cpus 3 and 19), in hwloc's logical order (which keeps
   the cores of a cache, a NUMA node and a package together). It uses the cores of the topology's
   allowed cpuset (cgroups), narrowed to desc.cpus when given, else, on this machine, to the cpus the
   process is bound to when planning (mpirun --bind-to, taskset, numactl: the placement never moves a
   thread outside its launcher's choice; give desc.cpus or mpirun --bind-to none to plan freely).

   Domains. A GPU rank's domain is the set of cores local to its GPU: those of the object its PCI
   device hangs from (hwloc's non-I/O ancestor: the GPU's NUMA node or package), or, when the topology
   of this machine has no PCI objects, the kernel's local_cpus of the device (through
   hwloc_cudart_get_device_cpuset for a CUDA ordinal, sysfs for a bus id).
   Ranks whose GPUs have the same domain share it; domains are planned smallest first, each on its
   cores that earlier domains did not take (all of them when none is left). CPU ranks form one domain,
   planned last: every core the GPU ranks left (every core, when they left none).

   In a domain with k ranks and f free cores:
     f >= 2k  the cores are shared out NUMA node by NUMA node, in proportion to each node's cores
              (largest remainders; a rank never straddles two nodes), and each rank gets a contiguous
              block of at least two: the averaging thread its last core, the worker the others. So a
              single GPU rank per socket gets the whole socket (its worker all but one core, for the
              threads its callbacks and the CUDA driver start, which inherit its binding).
     k <= f < 2k  every worker gets one core of its own; the f - k spare cores host the averaging
              threads (contiguous groups: ranks 0, 1 -> the first spare, ...), and with no spare core
              each averaging thread shares its own worker's core. Averaging is short and runs between a
              pipeline's STEP and its next forward, so it costs a worker less than a worker costs
              another: workers get cores first.
     f < k    workers share cores: rank i's worker and averaging thread on core floor(i f / k), so
              neighbouring ranks pile up together. The placement is then not exclusive (see binding).

   Binding (desc.bind). The placement is plain data: making one and printing its report changes nothing.
   Binding happens only where you apply it, by installing avgpipe_hwloc_bind_thread as the run's
   bind_thread or calling avgpipe_hwloc_bind / avgpipe_hwloc_bind_process; that is the opt-in. Then:
     AVGPIPE_HWLOC_BIND_AUTO (default) binds when the placement is exclusive: every worker has cores no
        other worker has. That is when binding pays (no migration, memory first-touched on the node
        that uses it, the GPU's PCIe root close) and cannot hurt. When workers would share cores it
        leaves the threads unbound: pinning would freeze a pile-up that the scheduler can even out
        between unequal stages. This is what the CPU runtime wants: stage threads on distinct cores
        where there are enough, nothing forced where there are not.
     AVGPIPE_HWLOC_BIND_ALWAYS binds as planned, shared cores too.
     AVGPIPE_HWLOC_BIND_NONE   report only: the callback and the functions succeed without binding.
   The examples keep binding off unless asked (fashion_mnist --bind auto): a shared test machine, or
   a job whose launcher already binds, is better left alone by default.

   NICs. For each GPU the report names the nearest network device (hwloc OS devices of type network,
   e.g. ib0, eth0, and OpenFabrics, e.g. mlx5_0), with nvidia-smi's distance classes:
     PIX   behind the same PCIe bridge (both devices' parent)     PXB  behind a common PCIe switch
     PHB   under the same PCIe host bridge                        NODE on the same NUMA node (another host bridge)
     SYS   on another NUMA node (crossing the socket interconnect)
   At equal distance an RDMA device (OpenFabrics) comes first, then topology order. A CPU rank gets the
   NIC nearest its cores' NUMA node (NODE or SYS). This is diagnostic only: nothing here tells NCCL or
   MPI which NIC to use (NCCL finds its own by the same PCI distances; NCCL_IB_HCA and
   NCCL_SOCKET_IFNAME override it). A report that shows a GPU whose nearest NIC is SYS is a reason to
   check the job's NIC settings, not something this header fixes.

   THE REPORT
   ----------
   avgpipe_hwloc_placement_report writes, for example (two sockets, four GPUs, two InfiniBand NICs):
     hwloc placement on server2s4g (from XML): 2 packages, 2 NUMA nodes, 16 cores, 32 PUs; 4 ranks over 16 cores (cpus 0-31)
     binding: auto -> on: every worker has cores of its own
     rank 0: gpu 0000:d8:00.0 cuda0 (numa 1); worker cores 8-10 (cpus 8-10,24-26), averaging core 11 (cpus 11,27), numa 1; nic mlx5_1,ib1 0000:b1:00.0 (NODE: same NUMA node)
     ...
     NICs are diagnostic: NCCL and MPI choose their own.
   Cores are hwloc's logical indexes (lstopo's L#), cpus are the operating system's numbers (what
   taskset, numactl and /proc/cpuinfo say). "shared" after a set says another planned worker (or, for
   the averaging core, any other planned thread) may run there; a "note" says why a rank is not where
   the policy wanted it (its GPU's cores outside the cpus planned over, or taken by another domain).

   WITH MPI (one process per GPU)
   --------------------------------
   Each process plans every rank of its machine (so that the processes share the cores out without
   overlap: every process computes the same placement) and applies its own:
       MPI_Comm node; int nloc, me_loc, ranks[64]; const char *gpus[64]; char ord[64][8];
       MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
       MPI_Comm_size(node, &nloc); MPI_Comm_rank(node, &me_loc);
       MPI_Allgather(&me, 1, MPI_INT, ranks, 1, MPI_INT, node);        // the global ranks on this machine
       for (i = 0; i < nloc; i++) snprintf(ord[i], 8, "%d", i), gpus[i] = ord[i];  // local i on GPU i
       pd.count = nloc; pd.ranks = ranks; pd.gpus = gpus;
       avgpipe_hwloc_placement_create(&ctx, topo, &pd, &placement);              // same placement in every process
       avgpipe_hwloc_bind_process(&ctx, placement, me);    // before cudaSetDevice and NCCL: the driver's
                                                      // threads and pinned buffers start near the GPU
       desc.bind_thread = avgpipe_hwloc_bind_thread; desc.bind_user = placement;
   Launch with `mpirun --bind-to none` (Open MPI binds to a core for np <= 2 and to a package above:
   the placement then only sees that). When the launcher gives each process one GPU (CUDA_VISIBLE_DEVICES per
   process), every process's ordinal 0 is another GPU: gather PCI bus ids (cudaDeviceGetPCIBusId)
   over `node` instead of ordinals.

   GPUS
   ----
   desc.gpus[i] names rank i's GPU as a PCI bus id ("0000:3b:00.0", or "3b:00.0" in domain 0), found
   among the topology's PCI devices (on this machine without them: Linux's sysfs local_cpus), or as a
   CUDA ordinal ("2" or "cuda2"): on this machine with the CUDA runtime (AVGPIPE_HWLOC_CUDART, on by
   default under nvcc) through hwloc/cudart.h, whose cudaGetDeviceProperties gives the bus id (this
   initialises CUDA in the calling process: place after any fork) and hwloc_cudart_get_device_cpuset the
   cpus when the topology has no PCI objects; else through the topology's CUDA OS device "cudaN"
   (hwloc's CUDA plugin adds them; an XML from a GPU machine has them). CUDA numbers devices fastest
   first unless CUDA_DEVICE_ORDER=PCI_BUS_ID: ordinal and bus order may differ.

   LIMITS
   ------
   - Cores only: the placement binds threads, not memory. The runtime's buffers are allocated (and, when
     zeroed, first touched) by the thread that creates the run: in one process per GPU, bind the
     process first (avgpipe_hwloc_bind_process) so they land on the GPU's node; in threads mode they
     land where the creating thread runs.
   - A thread started by a bound thread inherits its binding: the CPU device's kernel threads
     (avgpipe_device_cpu_desc.threads > 1) start on the averaging thread, and would share its one core
     (keep threads at 1 with binding, or BIND_NONE); BLAS or OpenMP threads your callbacks start share
     the worker's cores.
   - One placement is one machine: ranks on other machines are planned by their own processes.
   - Hybrid CPUs (performance and efficiency cores) are treated alike; hwloc's cpukinds are not read.
   - A topology loaded from XML is not this machine unless desc.is_this_system says so: its plans are
     for reading (binding one fails with AVGPIPE_UNSUPPORTED).
   - hwloc itself may print warnings about a malformed XML file on stderr (HWLOC_XML_VERBOSE).

   THREAD-SAFETY
   -------------
   Loading a topology and making a placement use one thread. A finished placement is read-only: any number of
   threads may call avgpipe_hwloc_bind_thread, avgpipe_hwloc_bind and the query functions on it at
   once (the runtime's threads all start together). Keep the placement and its topology alive while a run
   that uses it exists.

   CONFIGURATION MACROS
   --------------------
     AVGPIPE_HWLOC_IMPLEMENTATION  compile the implementation here (AVGPIPE_IMPLEMENTATION and
                                   AVGPIPE_IMPL turn it on too).
     AVGPIPE_HWLOC_CUDART          resolve CUDA ordinals with the CUDA runtime (hwloc/cudart.h: -I the
                                   CUDA include directory, -lcudart). Defined by default under nvcc;
                                   AVGPIPE_HWLOC_NO_CUDART keeps it off there.
   License: MIT, as avgpipe.h. */
#ifndef AVGPIPE_HWLOC_H
#define AVGPIPE_HWLOC_H

#ifndef AVGPIPE_H
#error "avgpipe_hwloc.h: include avgpipe.h first"
#endif
#if AVGPIPE_VERSION_NUMBER != 1003 /* released together: 0.10.3 */
#error "avgpipe_hwloc.h is version 0.10.3: include the avgpipe.h of the same release"
#endif

#include <hwloc.h>

#if defined(__CUDACC__) && !defined(AVGPIPE_HWLOC_CUDART) && !defined(AVGPIPE_HWLOC_NO_CUDART)
#define AVGPIPE_HWLOC_CUDART 1
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Longest text of a cpu or core list in a place (longer lists end in "..."). */
#define AVGPIPE_HWLOC_TEXT 128

/* A loaded topology (opaque). */
typedef struct avgpipe_hwloc_topo avgpipe_hwloc_topo;

/* Zero-initialise; zero fields mean:
     xml_path, xml    NULL -> this machine, discovered now (with its PCI and OS devices: hwloc keeps
                      the "important" ones, GPUs, NICs, disks and the bridges above them)
     xml_len          0 -> strlen(xml)
     is_this_system   0 -> an XML topology is another machine's: placements from it are for reading only;
                      1 -> it describes this machine (exported here, e.g. to start faster at scale):
                      binding works                                                                  */
typedef struct avgpipe_hwloc_topo_desc {
    const char *xml_path; /* an XML file (hwloc 2.x format: lstopo file.xml) */
    const char *xml;      /* or XML text in memory */
    size_t xml_len;
    int is_this_system;
} avgpipe_hwloc_topo_desc;

/* desc with its defaults filled in (xml_len 0 -> strlen(xml) when xml is given; the NULLs above mean
   what they say). No validation; desc may be NULL. Thread-safe. */
AVGPIPE_API avgpipe_hwloc_topo_desc avgpipe_hwloc_topo_query_defaults(const avgpipe_hwloc_topo_desc *desc);
/* Load a topology (desc may be NULL: this machine). Errors: AVGPIPE_INVALID_ARG (both xml_path and xml),
   AVGPIPE_IO_ERROR (the file cannot be read), AVGPIPE_PARSE_ERROR (hwloc refuses the XML),
   AVGPIPE_BACKEND_ERROR (hwloc cannot discover this machine), AVGPIPE_OUT_OF_MEMORY; the detail names
   the file and hwloc's errno text. ctx must outlive the topology. Release with avgpipe_hwloc_topo_free. */
AVGPIPE_API avgpipe_result avgpipe_hwloc_topo_load(avgpipe_context *ctx, const avgpipe_hwloc_topo_desc *desc,
                                                   avgpipe_hwloc_topo **out);
/* Release a topology (NULL is harmless), after every placement made from it. */
AVGPIPE_API void avgpipe_hwloc_topo_free(avgpipe_hwloc_topo *topo);
/* hwloc's own handle, for what this header does not ask (read it; do not modify it while placements exist). */
AVGPIPE_API hwloc_topology_t avgpipe_hwloc_topo_hwloc(const avgpipe_hwloc_topo *topo);
/* 1 if binding on this topology acts on this machine (discovered here, or XML with is_this_system). */
AVGPIPE_API int avgpipe_hwloc_topo_is_this_system(const avgpipe_hwloc_topo *topo);

typedef enum avgpipe_hwloc_bind_mode {
    AVGPIPE_HWLOC_BIND_AUTO = 0, /* bind when every worker has cores of its own (the placement is exclusive) */
    AVGPIPE_HWLOC_BIND_NONE,     /* report only */
    AVGPIPE_HWLOC_BIND_ALWAYS    /* bind as planned, shared cores too */
} avgpipe_hwloc_bind_mode;

/* The ranks to plan: those of this machine (one process's, or every process's on it; see WITH MPI).
   Zero-initialise; zero fields mean:
     count  must be >= 1
     ranks  NULL -> ranks 0 .. count-1 (else count distinct global ranks >= 0)
     gpus   NULL -> every rank a CPU rank; an entry NULL or "" -> that rank is a CPU rank; else its
            GPU: a PCI bus id ("0000:3b:00.0", "3b:00.0") or a CUDA ordinal ("2", "cuda2")
     bind   AVGPIPE_HWLOC_BIND_AUTO
     cpus   NULL -> the allowed cpus, narrowed on this machine to the process's binding; else plan over
            these OS cpus only (hwloc's list syntax, "0-15,32-47")
   (Nothing here has a value to fill in, so there is no query_defaults: avgpipe_hwloc_placement_query
   says what a placement resolved.)                                                                   */
typedef struct avgpipe_hwloc_placement_desc {
    int count;
    const int *ranks;
    const char *const *gpus;
    avgpipe_hwloc_bind_mode bind;
    const char *cpus;
} avgpipe_hwloc_placement_desc;

/* How far a NIC is from a GPU (nvidia-smi topo's names); see "NICs" above. */
typedef enum avgpipe_hwloc_nic_distance {
    AVGPIPE_HWLOC_NIC_NONE = 0, /* no network device in the topology */
    AVGPIPE_HWLOC_NIC_PIX,      /* the same PCIe bridge is the parent of both */
    AVGPIPE_HWLOC_NIC_PXB,      /* a common PCIe bridge higher up, below the host bridge */
    AVGPIPE_HWLOC_NIC_PHB,      /* the same PCIe host bridge */
    AVGPIPE_HWLOC_NIC_NODE,     /* the same NUMA node, another host bridge */
    AVGPIPE_HWLOC_NIC_SYS       /* another NUMA node */
} avgpipe_hwloc_nic_distance;

/* "PIX", "PXB", "PHB", "NODE", "SYS", "none"; never NULL. Thread-safe. */
AVGPIPE_API const char *avgpipe_hwloc_nic_distance_name(avgpipe_hwloc_nic_distance d);

/* Where one rank goes. Strings are NUL-terminated, "" when there is nothing to say. */
typedef struct avgpipe_hwloc_place {
    int rank;                              /* global rank */
    int cuda;                              /* its CUDA ordinal (given, or its cudaN device's), else -1 */
    char gpu[16];                          /* its GPU's PCI bus id "0000:3b:00.0"; "" for a CPU rank */
    char gpu_name[16];                     /* the GPU's OS device ("cuda1", "nvml0", "card0"), else "" */
    int gpu_numa;                          /* NUMA node (OS index) local to the GPU; -1 for a CPU rank,
                                              or a GPU attached above the NUMA nodes */
    int numa;                              /* NUMA node (OS index) of the worker's cores */
    char worker_cores[AVGPIPE_HWLOC_TEXT]; /* logical indexes of the worker's cores ("0-2") */
    char worker_cpus[AVGPIPE_HWLOC_TEXT];  /* their OS cpus ("0-2,16-18") */
    char avg_cores[AVGPIPE_HWLOC_TEXT];    /* the averaging thread's core ("3") */
    char avg_cpus[AVGPIPE_HWLOC_TEXT];     /* its OS cpus ("3,19") */
    int worker_shared;                     /* 1: another rank's worker is planned on a core of this one's */
    int avg_shared;                        /* 1: another planned thread is on the averaging core */
    char nic[48];                          /* the nearest NIC's OS devices, RDMA first ("mlx5_0,ib0") */
    char nic_pci[16];                      /* its PCI bus id */
    avgpipe_hwloc_nic_distance nic_distance;
    char note[192];                        /* why the rank is not where the policy wanted it, else "" */
} avgpipe_hwloc_place;

/* A placement (opaque): the places of the planned ranks and their cpusets. */
typedef struct avgpipe_hwloc_placement avgpipe_hwloc_placement;

/* What a placement resolved. */
typedef struct avgpipe_hwloc_placement_info {
    int count;                     /* ranks planned */
    int cores;                     /* cores planned over (within the cpus below) */
    int numa_nodes;                /* NUMA nodes of those cores */
    int exclusive;                 /* 1: no core is planned for two workers */
    int binds;                     /* 1: avgpipe_hwloc_bind* bind (bind mode and exclusive decide) */
    avgpipe_hwloc_bind_mode bind;  /* the mode */
    int this_system;               /* the topology is this machine's */
    char cpus[AVGPIPE_HWLOC_TEXT]; /* the OS cpus planned over */
    char machine[64];              /* the topology's host name */
} avgpipe_hwloc_placement_info;

/* Plan desc->count ranks on topo (see THE POLICY). topo must outlive the placement. Errors name the rank and
   the field: AVGPIPE_INVALID_ARG (count < 1, duplicate or negative ranks, a GPU that is neither a bus id
   nor an ordinal, a bus id or ordinal the topology does not have, cpus that do not parse or hold no
   core of the topology), AVGPIPE_OUT_OF_MEMORY. Deterministic: the same topology and desc give the
   same placement in every process. Release with avgpipe_hwloc_placement_free. */
AVGPIPE_API avgpipe_result avgpipe_hwloc_placement_create(avgpipe_context *ctx, const avgpipe_hwloc_topo *topo,
                                                     const avgpipe_hwloc_placement_desc *desc, avgpipe_hwloc_placement **out);
/* Release a placement (NULL is harmless), after the run that binds with it. */
AVGPIPE_API void avgpipe_hwloc_placement_free(avgpipe_hwloc_placement *placement);
/* What the placement resolved (zeroes for NULL). Thread-safe. */
AVGPIPE_API avgpipe_hwloc_placement_info avgpipe_hwloc_placement_query(const avgpipe_hwloc_placement *placement);
/* The place of global rank `rank`, NULL when the placement has none. Valid while the placement lives. Thread-safe. */
AVGPIPE_API const avgpipe_hwloc_place *avgpipe_hwloc_placement_rank(const avgpipe_hwloc_placement *placement, int rank);
/* Copy the cpus planned for a rank's thread into `out` (an hwloc bitmap you allocated): role
   AVGPIPE_THREAD_WORKER, AVGPIPE_THREAD_AVERAGING, or AVGPIPE_HWLOC_ROLE_RANK (both together).
   AVGPIPE_INVALID_ARG for a rank not planned or another role. Thread-safe (ctx: one thread's). */
AVGPIPE_API avgpipe_result avgpipe_hwloc_placement_cpuset(avgpipe_context *ctx, const avgpipe_hwloc_placement *placement, int rank, int role,
                                                     hwloc_bitmap_t out);
/* Append the report (THE REPORT above: a header, one line per rank in the order planned, a footer; each
   line ends in '\n') to *out. AVGPIPE_INVALID_ARG, AVGPIPE_OUT_OF_MEMORY. */
AVGPIPE_API avgpipe_result avgpipe_hwloc_placement_report(avgpipe_context *ctx, const avgpipe_hwloc_placement *placement, avgpipe_buf *out);

/* Role of a rank's threads together (the worker's cores and the averaging core), for binding a whole
   process or your own threads; beside avgpipe.h's AVGPIPE_THREAD_WORKER and AVGPIPE_THREAD_AVERAGING. */
#define AVGPIPE_HWLOC_ROLE_RANK 2

/* Bind the calling thread as planned for (rank, role) with hwloc_set_cpubind(HWLOC_CPUBIND_THREAD),
   when the placement binds (avgpipe_hwloc_placement_info.binds; otherwise return AVGPIPE_OK doing nothing).
   Errors: AVGPIPE_INVALID_ARG (placement NULL, rank not planned, role not WORKER, AVERAGING or
   AVGPIPE_HWLOC_ROLE_RANK), AVGPIPE_UNSUPPORTED (the topology is not this machine's), AVGPIPE_BACKEND_ERROR
   (hwloc refused: its errno text and the cpus); the detail goes to ctx (NULL: this thread's buffer).
   Thread-safe: any threads at once, each with its own ctx or NULL. */
AVGPIPE_API avgpipe_result avgpipe_hwloc_bind(avgpipe_context *ctx, const avgpipe_hwloc_placement *placement, int rank, int role);
/* The same for the whole process (HWLOC_CPUBIND_PROCESS: every thread it has, and those it starts later
   inherit it) on the rank's cores (AVGPIPE_HWLOC_ROLE_RANK). For one process per GPU, before CUDA and
   NCCL start their threads. */
AVGPIPE_API avgpipe_result avgpipe_hwloc_bind_process(avgpipe_context *ctx, const avgpipe_hwloc_placement *placement, int rank);
/* avgpipe_run_desc.bind_thread: desc.bind_user = the placement. avgpipe_hwloc_bind(NULL, placement, rank, role):
   returns 0, or the avgpipe_result (negative; the runtime logs it and the thread runs unbound; the
   detail is in that thread's avgpipe_last_error(NULL)). */
AVGPIPE_API int avgpipe_hwloc_bind_thread(int rank, int role, void *placement);

#ifdef __cplusplus
}
#endif
#endif /* AVGPIPE_HWLOC_H */

/* ============================================================================================ */
/* Implementation                                                                                */
/* ============================================================================================ */
#if (defined(AVGPIPE_HWLOC_IMPLEMENTATION) || defined(AVGPIPE_IMPLEMENTATION) || defined(AVGPIPE_IMPL)) && \
    !defined(AVGPIPE_HWLOC_IMPLEMENTATION_INCLUDED)
#define AVGPIPE_HWLOC_IMPLEMENTATION_INCLUDED

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <hwloc/linux.h>
#endif
#ifdef AVGPIPE_HWLOC_CUDART
#include <hwloc/cudart.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

struct avgpipe_hwloc_topo {
    avgpipe_context *ctx;
    hwloc_topology_t t;
    int this_system;
};

/* A core the placement may use: its cpus within the planned cpus, its NUMA node, the threads planned on it. */
typedef struct avgpipe__hwcore {
    hwloc_obj_t obj;
    hwloc_bitmap_t set;
    hwloc_obj_t numa;
    int workers, threads;
} avgpipe__hwcore;

struct avgpipe_hwloc_placement {
    avgpipe_context *ctx;
    const avgpipe_hwloc_topo *topo;
    avgpipe_hwloc_placement_info info;
    avgpipe_hwloc_place *place; /* [count] */
    hwloc_bitmap_t *set;        /* [3 * count]: worker, averaging, both */
};

/* ---- topology ----------------------------------------------------------------------------------- */

AVGPIPE_API avgpipe_hwloc_topo_desc avgpipe_hwloc_topo_query_defaults(const avgpipe_hwloc_topo_desc *desc) {
    avgpipe_hwloc_topo_desc d;
    if (desc) d = *desc;
    else memset(&d, 0, sizeof d);
    if (d.xml && !d.xml_len) d.xml_len = strlen(d.xml);
    return d;
}

AVGPIPE_API avgpipe_result avgpipe_hwloc_topo_load(avgpipe_context *ctx, const avgpipe_hwloc_topo_desc *desc,
                                                   avgpipe_hwloc_topo **out) {
    avgpipe_hwloc_topo_desc d;
    avgpipe_hwloc_topo *topo;
    char *text = NULL;
    int err;
    if (!out) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_topo_load: out is NULL");
    *out = NULL;
    d = avgpipe_hwloc_topo_query_defaults(desc);
    if (d.xml_path && d.xml)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_topo_load: give xml_path or xml, not both");
    if (d.xml && d.xml_len > (size_t)0x7ffffffe)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_topo_load: xml_len %zu is over 2 GiB", d.xml_len);
    if (d.xml_path) {
        FILE *f = fopen(d.xml_path, "rb");
        if (!f) return avgpipe_set_error(ctx, AVGPIPE_IO_ERROR, "avgpipe_hwloc_topo_load: %s: %s", d.xml_path, strerror(errno));
        fclose(f);
    }
    topo = (avgpipe_hwloc_topo *)avgpipe_alloc(ctx, sizeof *topo);
    if (d.xml && topo) text = (char *)avgpipe_alloc(ctx, d.xml_len + 1); /* hwloc wants the final NUL counted */
    if (!topo || (d.xml && !text) || hwloc_topology_init(&topo->t) != 0) {
        avgpipe_free(ctx, text);
        avgpipe_free(ctx, topo);
        return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_topo_load: out of memory");
    }
    topo->ctx = ctx;
    /* PCI and OS devices locate GPUs and NICs: from XML keep what the file says, here the important ones. */
    hwloc_topology_set_io_types_filter(topo->t, d.xml_path || d.xml ? HWLOC_TYPE_FILTER_KEEP_ALL : HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if ((d.xml_path || d.xml) && d.is_this_system) hwloc_topology_set_flags(topo->t, HWLOC_TOPOLOGY_FLAG_IS_THISSYSTEM);
    err = 0;
    if (d.xml_path) err = hwloc_topology_set_xml(topo->t, d.xml_path);
    else if (d.xml) {
        memcpy(text, d.xml, d.xml_len);
        text[d.xml_len] = 0;
        err = hwloc_topology_set_xmlbuffer(topo->t, text, (int)d.xml_len + 1);
    }
    if (!err) err = hwloc_topology_load(topo->t);
    avgpipe_free(ctx, text);
    if (err) {
        int e = errno;
        hwloc_topology_destroy(topo->t);
        avgpipe_free(ctx, topo);
        if (d.xml_path || d.xml)
            return avgpipe_set_error(ctx, AVGPIPE_PARSE_ERROR, "avgpipe_hwloc_topo_load: hwloc cannot load the XML topology %s: %s",
                                     d.xml_path ? d.xml_path : "(from memory)", strerror(e));
        return avgpipe_set_error(ctx, AVGPIPE_BACKEND_ERROR, "avgpipe_hwloc_topo_load: hwloc cannot discover this machine: %s",
                                 strerror(e));
    }
    hwloc_topology_refresh(topo->t); /* after this, threads may read the topology at once */
    topo->this_system = hwloc_topology_is_thissystem(topo->t);
    *out = topo;
    return AVGPIPE_OK;
}

AVGPIPE_API void avgpipe_hwloc_topo_free(avgpipe_hwloc_topo *topo) {
    if (!topo) return;
    hwloc_topology_destroy(topo->t);
    avgpipe_free(topo->ctx, topo);
}

AVGPIPE_API hwloc_topology_t avgpipe_hwloc_topo_hwloc(const avgpipe_hwloc_topo *topo) { return topo ? topo->t : NULL; }

AVGPIPE_API int avgpipe_hwloc_topo_is_this_system(const avgpipe_hwloc_topo *topo) { return topo ? topo->this_system : 0; }

AVGPIPE_API const char *avgpipe_hwloc_nic_distance_name(avgpipe_hwloc_nic_distance d) {
    switch (d) {
    case AVGPIPE_HWLOC_NIC_PIX: return "PIX";
    case AVGPIPE_HWLOC_NIC_PXB: return "PXB";
    case AVGPIPE_HWLOC_NIC_PHB: return "PHB";
    case AVGPIPE_HWLOC_NIC_NODE: return "NODE";
    case AVGPIPE_HWLOC_NIC_SYS: return "SYS";
    default: return "none";
    }
}

/* ---- planning state ----------------------------------------------------------------------------- */

typedef struct avgpipe__hwrank {
    hwloc_obj_t pcidev;  /* the GPU's PCI device, when the topology has it */
    hwloc_bitmap_t near; /* the cpus local to the GPU; NULL for a CPU rank */
    hwloc_bitmap_t domain;
    hwloc_bitmap_t worker; /* core table indexes */
    int avg;               /* core table index */
    int order;             /* position of its domain in planning order */
} avgpipe__hwrank;

typedef struct avgpipe__hwplan {
    avgpipe_context *ctx;
    hwloc_topology_t t;
    int ncores, count;
    avgpipe__hwcore *core;
    avgpipe__hwrank *r;
    avgpipe_hwloc_place *place;
    hwloc_bitmap_t cand; /* the cpus planned over */
    /* scratch, one allocation: [ncores] each, then [count] each */
    int *cl, *L, *node, *cnt, *kk, *extra, *members, *seen;
} avgpipe__hwplan;

static void avgpipe__hw_note(avgpipe_hwloc_place *p, const char *fmt, ...)
#if defined(__GNUC__) || defined(__clang__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void avgpipe__hw_note(avgpipe_hwloc_place *p, const char *fmt, ...) {
    va_list ap;
    size_t n = strlen(p->note);
    if (n + 3 >= sizeof p->note) return;
    if (n) memcpy(p->note + n, "; ", 3), n += 2;
    va_start(ap, fmt);
    vsnprintf(p->note + n, sizeof p->note - n, fmt, ap);
    va_end(ap);
}

/* A list in hwloc's syntax into dst; a list that does not fit ends in "...". */
static void avgpipe__hw_list(char *dst, size_t cap, hwloc_const_bitmap_t set) {
    int n = hwloc_bitmap_list_snprintf(dst, cap, set);
    if (n >= (int)cap && cap > 4) memcpy(dst + cap - 4, "...", 4);
    if (n < 0 && cap) dst[0] = 0;
}

static void avgpipe__hw_busid(char *dst, size_t cap, hwloc_obj_t pci) {
    snprintf(dst, cap, "%04x:%02x:%02x.%01x", (unsigned)pci->attr->pcidev.domain, (unsigned)pci->attr->pcidev.bus,
             (unsigned)pci->attr->pcidev.dev, (unsigned)pci->attr->pcidev.func);
}

/* The NUMA node (first in logical order) whose cpus include `set`; NULL when none does. */
static hwloc_obj_t avgpipe__hw_numa_of(hwloc_topology_t t, hwloc_const_bitmap_t set) {
    hwloc_obj_t n = NULL;
    while ((n = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_NUMANODE, n)) != NULL)
        if (n->cpuset && !hwloc_bitmap_iszero(set) && hwloc_bitmap_isincluded(set, n->cpuset)) return n;
    return NULL;
}

/* The cores (PUs when the topology has no cores) within the cpus planned over, in logical order. */
static avgpipe_result avgpipe__hw_cores(avgpipe__hwplan *w) {
    hwloc_obj_type_t type = hwloc_get_nbobjs_by_type(w->t, HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
    int n = hwloc_get_nbobjs_by_type(w->t, type), i;
    w->core = (avgpipe__hwcore *)avgpipe_alloc(w->ctx, (size_t)(n > 0 ? n : 1) * sizeof *w->core);
    if (!w->core) return avgpipe_set_error(w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
    memset(w->core, 0, (size_t)(n > 0 ? n : 1) * sizeof *w->core);
    w->ncores = 0;
    for (i = 0; i < n; i++) {
        hwloc_obj_t o = hwloc_get_obj_by_type(w->t, type, (unsigned)i);
        avgpipe__hwcore *c = &w->core[w->ncores];
        if (!o || !o->cpuset || !hwloc_bitmap_intersects(o->cpuset, w->cand)) continue;
        if (!(c->set = hwloc_bitmap_alloc()))
            return avgpipe_set_error(w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
        hwloc_bitmap_and(c->set, o->cpuset, w->cand);
        c->obj = o;
        c->numa = avgpipe__hw_numa_of(w->t, o->cpuset);
        w->ncores++;
    }
    return AVGPIPE_OK;
}

/* ---- GPUs --------------------------------------------------------------------------------------- */

/* "2", "cuda2", "cuda:2" -> 2. */
static int avgpipe__hw_ordinal(const char *s, int *ord) {
    const char *p = s;
    int v = 0;
    if (!strncmp(p, "cuda", 4)) p += 4 + (p[4] == ':');
    if (!*p || strlen(p) > 6) return 0;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') return 0;
        v = v * 10 + (*p - '0');
    }
    *ord = v;
    return 1;
}

/* "0000:3b:00.0" or "3b:00.0" (domain 0), hexadecimal. */
static int avgpipe__hw_parse_busid(const char *s, unsigned *dom, unsigned *bus, unsigned *dev, unsigned *fn) {
    const char *p;
    char tail;
    for (p = s; *p; p++) /* digits, colons and one dot only: sscanf alone would take "0x" and signs */
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f') || (*p >= 'A' && *p <= 'F') || *p == ':' || *p == '.')) return 0;
    if (sscanf(s, "%x:%x:%x.%x%c", dom, bus, dev, fn, &tail) != 4) {
        *dom = 0;
        if (sscanf(s, "%x:%x.%x%c", bus, dev, fn, &tail) != 3) return 0;
    }
    return *dom <= 0xffff && *bus <= 0xff && *dev <= 0x1f && *fn <= 7;
}

/* The topology's CUDA OS device of ordinal `ord` ("cudaN", a co-processor). */
static hwloc_obj_t avgpipe__hw_cuda_osdev(hwloc_topology_t t, int ord) {
    hwloc_obj_t o = NULL;
    char want[24];
    snprintf(want, sizeof want, "cuda%d", ord);
    while ((o = hwloc_get_next_osdev(t, o)) != NULL)
        if (o->attr->osdev.type == HWLOC_OBJ_OSDEV_COPROC && o->name && !strcmp(o->name, want)) return o;
    return NULL;
}

/* The name of a GPU's OS device: its CUDA device, else any GPU or co-processor device under it. */
static void avgpipe__hw_gpu_name(hwloc_obj_t pci, avgpipe_hwloc_place *p) {
    hwloc_obj_t o, any = NULL;
    int ord;
    for (o = pci->io_first_child; o; o = o->next_sibling) {
        if (o->type != HWLOC_OBJ_OS_DEVICE || !o->name) continue;
        if (o->attr->osdev.type == HWLOC_OBJ_OSDEV_COPROC && !strncmp(o->name, "cuda", 4) && avgpipe__hw_ordinal(o->name, &ord)) {
            snprintf(p->gpu_name, sizeof p->gpu_name, "%s", o->name);
            if (p->cuda < 0) p->cuda = ord;
            return;
        }
        if (!any && (o->attr->osdev.type == HWLOC_OBJ_OSDEV_GPU || o->attr->osdev.type == HWLOC_OBJ_OSDEV_COPROC)) any = o;
    }
    if (any && !p->gpu_name[0]) snprintf(p->gpu_name, sizeof p->gpu_name, "%s", any->name);
}

/* The cpus local to a PCI device that the topology lacks: Linux's sysfs, on this machine. */
static int avgpipe__hw_sysfs_near(const avgpipe_hwloc_topo *topo, unsigned dom, unsigned bus, unsigned dev, unsigned fn,
                                  hwloc_bitmap_t near) {
#if defined(__linux__)
    char path[96];
    if (!topo->this_system) return -1;
    snprintf(path, sizeof path, "/sys/bus/pci/devices/%04x:%02x:%02x.%01x/local_cpus", dom, bus, dev, fn);
    if (hwloc_linux_read_path_as_cpumask(path, near) < 0 || hwloc_bitmap_iszero(near)) return -1;
    return 0;
#else
    (void)topo, (void)dom, (void)bus, (void)dev, (void)fn, (void)near;
    return -1;
#endif
}

#ifdef AVGPIPE_HWLOC_CUDART
/* A CUDA ordinal through the CUDA runtime (this machine only): its PCI device, or, when the topology has
   no PCI objects, its local cpus (hwloc_cudart_get_device_cpuset: the kernel's local_cpus). */
static avgpipe_result avgpipe__hw_cudart(avgpipe__hwplan *w, int i, int ord) {
    int dom = 0, bus = 0, dev = 0;
    avgpipe_hwloc_place *p = &w->place[i];
    if (hwloc_cudart_get_device_pci_ids(w->t, ord, &dom, &bus, &dev) != 0)
        return avgpipe_set_error(w->ctx, AVGPIPE_INVALID_ARG,
                                 "avgpipe_hwloc_placement_create: rank %d: CUDA device %d: cudaGetDeviceProperties fails (no such device?)", p->rank, ord);
    snprintf(p->gpu, sizeof p->gpu, "%04x:%02x:%02x.0", (unsigned)dom, (unsigned)bus, (unsigned)dev);
    snprintf(p->gpu_name, sizeof p->gpu_name, "cuda%d", ord);
    w->r[i].pcidev = hwloc_get_pcidev_by_busid(w->t, (unsigned)dom, (unsigned)bus, (unsigned)dev, 0);
    if (!w->r[i].pcidev && hwloc_cudart_get_device_cpuset(w->t, ord, w->r[i].near) != 0)
        return avgpipe_set_error(w->ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: rank %d: CUDA device %d (%s): no local cpus",
                                 p->rank, ord, p->gpu);
    return AVGPIPE_OK;
}
#endif

/* Rank i's GPU: its PCI device and the cpus near it (r->near), or nothing for a CPU rank. */
static avgpipe_result avgpipe__hw_gpu(avgpipe__hwplan *w, const avgpipe_hwloc_topo *topo, int i, const char *spec) {
    avgpipe__hwrank *r = &w->r[i];
    avgpipe_hwloc_place *p = &w->place[i];
    unsigned dom, bus, dev, fn;
    int ord;
    if (!spec || !*spec) return AVGPIPE_OK;
    if (!(r->near = hwloc_bitmap_alloc())) return avgpipe_set_error(w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
    if (avgpipe__hw_ordinal(spec, &ord)) {
        hwloc_obj_t os;
        p->cuda = ord;
#ifdef AVGPIPE_HWLOC_CUDART
        if (topo->this_system) {
            avgpipe_result res = avgpipe__hw_cudart(w, i, ord);
            if (res || !r->pcidev) return res;
            os = NULL; /* found by bus id: on to what its PCI device says */
        } else
#endif
        if (!(os = avgpipe__hw_cuda_osdev(w->t, ord)) || !os->parent || os->parent->type != HWLOC_OBJ_PCI_DEVICE)
            return avgpipe_set_error(w->ctx, AVGPIPE_INVALID_ARG,
                                     "avgpipe_hwloc_placement_create: rank %d: gpus[%d] = \"%s\": the topology has no CUDA device cuda%d "
                                     "(hwloc lists them with its CUDA plugin)%s: give the GPU's PCI bus id",
                                     p->rank, i, spec, ord,
#ifdef AVGPIPE_HWLOC_CUDART
                                     ", and the CUDA runtime cannot be asked about another machine"
#else
                                     ", and this build has no CUDA runtime (AVGPIPE_HWLOC_CUDART)"
#endif
            );
        if (os) r->pcidev = os->parent;
    } else if (avgpipe__hw_parse_busid(spec, &dom, &bus, &dev, &fn)) {
        r->pcidev = hwloc_get_pcidev_by_busid(w->t, dom, bus, dev, fn);
        snprintf(p->gpu, sizeof p->gpu, "%04x:%02x:%02x.%01x", dom, bus, dev, fn);
        if (!r->pcidev) {
            if (avgpipe__hw_sysfs_near(topo, dom, bus, dev, fn, r->near) == 0) return AVGPIPE_OK;
            return avgpipe_set_error(w->ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: rank %d: gpus[%d] = \"%s\": no PCI device %s in the topology",
                                     p->rank, i, spec, p->gpu);
        }
    } else
        return avgpipe_set_error(w->ctx, AVGPIPE_INVALID_ARG,
                                 "avgpipe_hwloc_placement_create: rank %d: gpus[%d] = \"%s\" is neither a PCI bus id (\"0000:3b:00.0\") nor a CUDA "
                                 "ordinal (\"2\", \"cuda2\")", p->rank, i, spec);
    avgpipe__hw_busid(p->gpu, sizeof p->gpu, r->pcidev);
    avgpipe__hw_gpu_name(r->pcidev, p);
    hwloc_bitmap_copy(r->near, hwloc_get_non_io_ancestor_obj(w->t, r->pcidev)->cpuset);
    return AVGPIPE_OK;
}

/* ---- sharing out the cores ---------------------------------------------------------------------- */

/* k ranks over the cores L[0..n-1] of one NUMA node (k <= n): blocks of >= 2 cores (the averaging thread
   on the last), or one core per worker with the averaging threads on the spare cores (or their own). */
static void avgpipe__hw_assign_node(avgpipe__hwplan *w, const int *ranks, int k, const int *L, int n) {
    int i, j;
    for (i = 0; i < k; i++) {
        avgpipe__hwrank *r = &w->r[ranks[i]];
        if (n >= 2 * k) {
            int b = i * n / k, e = (i + 1) * n / k;
            for (j = b; j < e - 1; j++) hwloc_bitmap_set(r->worker, (unsigned)L[j]);
            r->avg = L[e - 1];
        } else {
            int spare = n - k;
            hwloc_bitmap_set(r->worker, (unsigned)L[i]);
            r->avg = spare > 0 ? L[k + i * spare / k] : L[i];
        }
    }
}


/* k ranks over the f cores cl[] of a domain (see THE POLICY). */
static void avgpipe__hw_assign(avgpipe__hwplan *w, const int *ranks, int k, const int *cl, int f) {
    int ng = 0, g, i, left, done = 0;
    if (f < k) { /* scarce: neighbours share, the averaging thread with its worker */
        for (i = 0; i < k; i++) {
            int c = cl[(long long)i * f / k];
            hwloc_bitmap_set(w->r[ranks[i]].worker, (unsigned)c);
            w->r[ranks[i]].avg = c;
        }
        return;
    }
    /* NUMA nodes in order of first appearance (node[g]: a core of node g) and their core counts */
    for (i = 0; i < f; i++) {
        for (g = 0; g < ng && w->core[w->node[g]].numa != w->core[cl[i]].numa; g++) {
        }
        if (g == ng) w->node[ng] = cl[i], w->cnt[ng++] = 0;
        w->cnt[g]++;
    }
    /* ranks per node: largest remainders of k * n_g / f, at most one extra per node, ties to the first */
    for (left = k, g = 0; g < ng; g++) {
        w->kk[g] = (int)((long long)k * w->cnt[g] / f);
        w->extra[g] = 0;
        left -= w->kk[g];
    }
    while (left-- > 0) {
        int best = -1;
        long long rem, brem = -1;
        for (g = 0; g < ng; g++)
            if (!w->extra[g] && w->kk[g] < w->cnt[g] && (rem = (long long)k * w->cnt[g] % f) > brem) best = g, brem = rem;
        if (best < 0) break; /* not reached: the remainders add up to what is left */
        w->kk[best]++, w->extra[best] = 1;
    }
    for (g = 0; g < ng && done < k; g++) {
        int n = 0, kk = w->kk[g] < k - done ? w->kk[g] : k - done;
        for (i = 0; i < f; i++)
            if (w->core[cl[i]].numa == w->core[w->node[g]].numa) w->L[n++] = cl[i];
        if (kk > 0) avgpipe__hw_assign_node(w, ranks + done, kk, w->L, n);
        done += kk;
    }
}

/* Plan the ranks of one domain: ranks[] share `set` (NULL: the CPU ranks, every planned core). */
static void avgpipe__hw_domain(avgpipe__hwplan *w, const int *ranks, int k, hwloc_const_bitmap_t set) {
    int f = 0, c, i;
    unsigned u;
    for (c = 0; c < w->ncores; c++)
        if (!w->core[c].threads && (!set || hwloc_bitmap_intersects(w->core[c].set, set))) w->cl[f++] = c;
    if (f == 0) { /* nothing left: share the domain's cores with the ranks that took them */
        for (c = 0; c < w->ncores; c++)
            if (!set || hwloc_bitmap_intersects(w->core[c].set, set)) w->cl[f++] = c;
        for (i = 0; i < k; i++)
            avgpipe__hw_note(&w->place[ranks[i]], "%s", set ? "the cores near its GPU are taken by other GPUs' ranks: shares them"
                                                             : "the GPU ranks took every core: shares them");
    }
    avgpipe__hw_assign(w, ranks, k, w->cl, f);
    for (i = 0; i < k; i++) {
        avgpipe__hwrank *r = &w->r[ranks[i]];
        hwloc_bitmap_foreach_begin(u, r->worker) {
            w->core[u].workers++;
            w->core[u].threads++;
        }
        hwloc_bitmap_foreach_end();
        w->core[r->avg].threads++;
    }
}

/* The GPU ranks by domain, smallest domain first (ties: the first rank's), then the CPU ranks. */
static void avgpipe__hw_domains(avgpipe__hwplan *w) {
    int i, j, k, left = 0;
    for (i = 0; i < w->count; i++) w->seen[i] = !w->r[i].near, left += !w->seen[i];
    while (left > 0) {
        int best = -1, bw = 0;
        for (i = 0; i < w->count; i++)
            if (!w->seen[i] && (best < 0 || hwloc_bitmap_weight(w->r[i].domain) < bw)) best = i, bw = hwloc_bitmap_weight(w->r[i].domain);
        for (k = 0, j = 0; j < w->count; j++)
            if (!w->seen[j] && hwloc_bitmap_isequal(w->r[j].domain, w->r[best].domain)) w->members[k++] = j, w->seen[j] = 1;
        left -= k;
        avgpipe__hw_domain(w, w->members, k, w->r[best].domain);
    }
    for (k = 0, i = 0; i < w->count; i++)
        if (!w->r[i].near) w->members[k++] = i;
    if (k) avgpipe__hw_domain(w, w->members, k, NULL);
}

/* ---- NICs --------------------------------------------------------------------------------------- */

static int avgpipe__hw_is_nic_osdev(hwloc_obj_t o) {
    return o->type == HWLOC_OBJ_OS_DEVICE &&
           (o->attr->osdev.type == HWLOC_OBJ_OSDEV_NETWORK || o->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS);
}

/* A NIC is a PCI device with a network or OpenFabrics OS device; rdma: it has an OpenFabrics one. */
static int avgpipe__hw_nic(hwloc_obj_t pci, int *rdma) {
    hwloc_obj_t o;
    int found = 0;
    *rdma = 0;
    for (o = pci->io_first_child; o; o = o->next_sibling)
        if (avgpipe__hw_is_nic_osdev(o)) found = 1, *rdma |= o->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS;
    return found;
}

static int avgpipe__hw_below(hwloc_obj_t x, hwloc_obj_t a) {
    for (x = x->parent; x; x = x->parent)
        if (x == a) return 1;
    return 0;
}

/* NODE when the two localities (cpusets) meet, else SYS. */
static avgpipe_hwloc_nic_distance avgpipe__hw_set_distance(hwloc_const_bitmap_t a, hwloc_const_bitmap_t b) {
    return hwloc_bitmap_intersects(a, b) ? AVGPIPE_HWLOC_NIC_NODE : AVGPIPE_HWLOC_NIC_SYS;
}

/* Distance from a GPU's PCI device (or, gpu NULL, from the cpus `near`) to the NIC `nic`. */
static avgpipe_hwloc_nic_distance avgpipe__hw_distance(hwloc_topology_t t, hwloc_obj_t gpu, hwloc_const_bitmap_t near, hwloc_obj_t nic) {
    hwloc_obj_t a;
    hwloc_const_bitmap_t nic_near = hwloc_get_non_io_ancestor_obj(t, nic)->cpuset;
    if (!gpu) return avgpipe__hw_set_distance(near, nic_near);
    for (a = gpu->parent; a && hwloc_obj_type_is_io(a->type); a = a->parent)
        if (avgpipe__hw_below(nic, a)) {
            if (a->type == HWLOC_OBJ_BRIDGE && a->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_HOST) return AVGPIPE_HWLOC_NIC_PHB;
            return gpu->parent == a && nic->parent == a ? AVGPIPE_HWLOC_NIC_PIX : AVGPIPE_HWLOC_NIC_PXB;
        }
    return avgpipe__hw_set_distance(hwloc_get_non_io_ancestor_obj(t, gpu)->cpuset, nic_near);
}

/* The nearest NIC of rank i: from its GPU's PCI device, or from `near` (its GPU's or its NUMA node's cpus). */
static void avgpipe__hw_nearest_nic(avgpipe__hwplan *w, int i, hwloc_const_bitmap_t near) {
    hwloc_obj_t pci = NULL, best = NULL, o;
    avgpipe_hwloc_nic_distance bd = AVGPIPE_HWLOC_NIC_NONE;
    avgpipe_hwloc_place *p = &w->place[i];
    int brdma = 0, rdma, pass;
    size_t n = 0;
    while ((pci = hwloc_get_next_pcidev(w->t, pci)) != NULL) {
        avgpipe_hwloc_nic_distance d;
        if (!avgpipe__hw_nic(pci, &rdma)) continue;
        d = avgpipe__hw_distance(w->t, w->r[i].pcidev, near, pci);
        if (!best || d < bd || (d == bd && rdma && !brdma)) best = pci, bd = d, brdma = rdma;
    }
    p->nic_distance = bd;
    if (!best) return;
    avgpipe__hw_busid(p->nic_pci, sizeof p->nic_pci, best);
    for (pass = 0; pass < 2; pass++) /* OpenFabrics names first (what NCCL_IB_HCA takes), then interfaces */
        for (o = best->io_first_child; o; o = o->next_sibling)
            if (avgpipe__hw_is_nic_osdev(o) && o->name && (o->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS) == (pass == 0) &&
                n + strlen(o->name) + 2 < sizeof p->nic) {
                n += (size_t)snprintf(p->nic + n, sizeof p->nic - n, "%s%s", n ? "," : "", o->name);
            }
}

/* ---- the placement ---------------------------------------------------------------------------------- */

static void avgpipe__hw_free_work(avgpipe__hwplan *w) {
    int i;
    for (i = 0; w->core && i < w->ncores; i++) hwloc_bitmap_free(w->core[i].set);
    for (i = 0; w->r && i < w->count; i++) {
        hwloc_bitmap_free(w->r[i].near);
        hwloc_bitmap_free(w->r[i].domain);
        hwloc_bitmap_free(w->r[i].worker);
    }
    hwloc_bitmap_free(w->cand);
    avgpipe_free(w->ctx, w->core);
    avgpipe_free(w->ctx, w->r);
    avgpipe_free(w->ctx, w->cl);
}

AVGPIPE_API void avgpipe_hwloc_placement_free(avgpipe_hwloc_placement *plan) {
    int i;
    if (!plan) return;
    for (i = 0; plan->set && i < 3 * plan->info.count; i++) hwloc_bitmap_free(plan->set[i]);
    avgpipe_free(plan->ctx, plan->set);
    avgpipe_free(plan->ctx, plan->place);
    avgpipe_free(plan->ctx, plan);
}

/* The cpus to plan over: allowed, narrowed by desc.cpus or (this machine) the process's binding. */
static avgpipe_result avgpipe__hw_candidates(avgpipe__hwplan *w, const avgpipe_hwloc_topo *topo, const avgpipe_hwloc_placement_desc *d) {
    hwloc_bitmap_t b = hwloc_bitmap_alloc();
    if (!(w->cand = hwloc_bitmap_dup(hwloc_topology_get_allowed_cpuset(w->t))) || !b) {
        hwloc_bitmap_free(b);
        return avgpipe_set_error(w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
    }
    if (d->cpus) {
        if (hwloc_bitmap_list_sscanf(b, d->cpus) != 0 || !hwloc_bitmap_intersects(b, w->cand)) {
            hwloc_bitmap_free(b);
            return avgpipe_set_error(w->ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: cpus \"%s\" %s", d->cpus,
                                     "is not a cpu list of this topology (hwloc list syntax: \"0-7,16-23\")");
        }
        hwloc_bitmap_and(w->cand, w->cand, b);
    } else if (topo->this_system && hwloc_get_cpubind(w->t, b, HWLOC_CPUBIND_PROCESS) == 0 && hwloc_bitmap_intersects(b, w->cand))
        hwloc_bitmap_and(w->cand, w->cand, b);
    hwloc_bitmap_free(b);
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__hw_check_desc(avgpipe_context *ctx, const avgpipe_hwloc_placement_desc *d) {
    int i, j;
    if (d->count < 1 || d->count > (1 << 20))
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: count is %d (1 .. 2^20)", d->count);
    if ((int)d->bind < AVGPIPE_HWLOC_BIND_AUTO || (int)d->bind > AVGPIPE_HWLOC_BIND_ALWAYS)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: bind is %d (auto, none or always)", (int)d->bind);
    for (i = 0; d->ranks && i < d->count; i++) {
        if (d->ranks[i] < 0) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: ranks[%d] is %d", i, d->ranks[i]);
        for (j = 0; j < i; j++)
            if (d->ranks[j] == d->ranks[i])
                return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: rank %d is planned twice (ranks[%d] and ranks[%d])",
                                         d->ranks[i], j, i);
    }
    return AVGPIPE_OK;
}

/* Set up the working state: cores, ranks, GPUs, domains. */
static avgpipe_result avgpipe__hw_prepare(avgpipe__hwplan *w, const avgpipe_hwloc_topo *topo, const avgpipe_hwloc_placement_desc *d) {
    avgpipe_result res;
    int i, n;
    if ((res = avgpipe__hw_candidates(w, topo, d)) || (res = avgpipe__hw_cores(w))) return res;
    if (w->ncores == 0) return avgpipe_set_error(w->ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: no core to plan over");
    n = 6 * w->ncores + 2 * w->count;
    w->r = (avgpipe__hwrank *)avgpipe_alloc(w->ctx, (size_t)w->count * sizeof *w->r);
    w->cl = (int *)avgpipe_alloc(w->ctx, (size_t)n * sizeof(int));
    if (!w->r || !w->cl) return avgpipe_set_error(w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
    memset(w->r, 0, (size_t)w->count * sizeof *w->r);
    w->L = w->cl + w->ncores, w->node = w->L + w->ncores, w->cnt = w->node + w->ncores, w->kk = w->cnt + w->ncores;
    w->extra = w->kk + w->ncores, w->members = w->extra + w->ncores, w->seen = w->members + w->count;
    for (i = 0; i < w->count; i++) {
        avgpipe_hwloc_place *p = &w->place[i];
        p->rank = d->ranks ? d->ranks[i] : i;
        p->cuda = -1, p->gpu_numa = -1, p->numa = -1;
        if (!(w->r[i].worker = hwloc_bitmap_alloc()))
            return avgpipe_set_error(w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
        if ((res = avgpipe__hw_gpu(w, topo, i, d->gpus ? d->gpus[i] : NULL))) return res;
        if (!w->r[i].near) continue;
        {
            hwloc_obj_t numa = avgpipe__hw_numa_of(w->t, w->r[i].near);
            char near[AVGPIPE_HWLOC_TEXT];
            p->gpu_numa = numa ? (int)numa->os_index : -1;
            if (!(w->r[i].domain = hwloc_bitmap_alloc()))
                return avgpipe_set_error(w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
            hwloc_bitmap_and(w->r[i].domain, w->r[i].near, w->cand);
            if (hwloc_bitmap_iszero(w->r[i].domain)) { /* its GPU's cpus are all outside the planned ones */
                avgpipe__hw_list(near, sizeof near, w->r[i].near);
                avgpipe__hw_note(p, "the cpus near its GPU (%s) are outside the cpus planned over", near);
                hwloc_bitmap_copy(w->r[i].domain, w->cand);
            }
        }
    }
    return AVGPIPE_OK;
}

/* The plan's strings, sharing flags and cpusets from the working state. */
static avgpipe_result avgpipe__hw_finish(avgpipe__hwplan *w, avgpipe_hwloc_placement *plan) {
    hwloc_bitmap_t idx = hwloc_bitmap_alloc();
    int i, exclusive = 1;
    unsigned u;
    if (!idx) return avgpipe_set_error(w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
    for (i = 0; i < w->count; i++) {
        avgpipe__hwrank *r = &w->r[i];
        avgpipe_hwloc_place *p = &w->place[i];
        hwloc_bitmap_t *s = &plan->set[3 * i];
        if (!(s[0] = hwloc_bitmap_alloc()) || !(s[1] = hwloc_bitmap_alloc()) || !(s[2] = hwloc_bitmap_alloc())) {
            hwloc_bitmap_free(idx);
            return avgpipe_set_error(w->ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
        }
        hwloc_bitmap_zero(idx);
        hwloc_bitmap_foreach_begin(u, r->worker) {
            hwloc_bitmap_or(s[0], s[0], w->core[u].set);
            hwloc_bitmap_set(idx, w->core[u].obj->logical_index);
            if (w->core[u].workers > 1) p->worker_shared = 1;
        }
        hwloc_bitmap_foreach_end();
        avgpipe__hw_list(p->worker_cores, sizeof p->worker_cores, idx);
        avgpipe__hw_list(p->worker_cpus, sizeof p->worker_cpus, s[0]);
        hwloc_bitmap_copy(s[1], w->core[r->avg].set);
        hwloc_bitmap_only(idx, w->core[r->avg].obj->logical_index);
        avgpipe__hw_list(p->avg_cores, sizeof p->avg_cores, idx);
        avgpipe__hw_list(p->avg_cpus, sizeof p->avg_cpus, s[1]);
        hwloc_bitmap_or(s[2], s[0], s[1]);
        p->avg_shared = w->core[r->avg].threads > 1;
        exclusive &= !p->worker_shared;
        {
            hwloc_obj_t numa = w->core[hwloc_bitmap_first(r->worker)].numa;
            p->numa = numa ? (int)numa->os_index : -1;
            if (r->pcidev || r->near) avgpipe__hw_nearest_nic(w, i, r->near);
            else avgpipe__hw_nearest_nic(w, i, numa ? numa->cpuset : s[0]);
        }
    }
    hwloc_bitmap_free(idx);
    plan->info.exclusive = exclusive;
    return AVGPIPE_OK;
}

static void avgpipe__hw_info(avgpipe__hwplan *w, const avgpipe_hwloc_topo *topo, const avgpipe_hwloc_placement_desc *d, avgpipe_hwloc_placement *plan) {
    avgpipe_hwloc_placement_info *in = &plan->info;
    const char *host = hwloc_obj_get_info_by_name(hwloc_get_root_obj(w->t), "HostName");
    int c, n, nn = 0;
    in->count = w->count;
    in->cores = w->ncores;
    for (c = 0; c < w->ncores; c++) { /* distinct NUMA nodes of the planned cores */
        for (n = 0; n < c && w->core[n].numa != w->core[c].numa; n++) {
        }
        nn += n == c;
    }
    in->numa_nodes = nn;
    in->bind = d->bind;
    in->this_system = topo->this_system;
    in->binds = d->bind == AVGPIPE_HWLOC_BIND_ALWAYS || (d->bind == AVGPIPE_HWLOC_BIND_AUTO && in->exclusive);
    avgpipe__hw_list(in->cpus, sizeof in->cpus, w->cand);
    snprintf(in->machine, sizeof in->machine, "%s", host ? host : "?");
}

AVGPIPE_API avgpipe_result avgpipe_hwloc_placement_create(avgpipe_context *ctx, const avgpipe_hwloc_topo *topo,
                                                     const avgpipe_hwloc_placement_desc *desc, avgpipe_hwloc_placement **out) {
    avgpipe__hwplan w;
    avgpipe_hwloc_placement *plan;
    avgpipe_result res;
    if (!out) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: out is NULL");
    *out = NULL;
    if (!topo || !desc) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_create: %s is NULL", topo ? "desc" : "topo");
    if ((res = avgpipe__hw_check_desc(ctx, desc))) return res;
    memset(&w, 0, sizeof w);
    w.ctx = ctx, w.t = topo->t, w.count = desc->count;
    plan = (avgpipe_hwloc_placement *)avgpipe_alloc(ctx, sizeof *plan);
    if (plan) {
        memset(plan, 0, sizeof *plan);
        plan->ctx = ctx, plan->topo = topo;
        plan->place = (avgpipe_hwloc_place *)avgpipe_alloc(ctx, (size_t)desc->count * sizeof *plan->place);
        plan->set = (hwloc_bitmap_t *)avgpipe_alloc(ctx, 3 * (size_t)desc->count * sizeof *plan->set);
    }
    if (!plan || !plan->place || !plan->set) {
        if (plan) avgpipe_free(ctx, plan->place), avgpipe_free(ctx, plan->set), avgpipe_free(ctx, plan);
        return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_create: out of memory");
    }
    memset(plan->place, 0, (size_t)desc->count * sizeof *plan->place);
    memset(plan->set, 0, 3 * (size_t)desc->count * sizeof *plan->set);
    plan->info.count = desc->count;
    w.place = plan->place;
    res = avgpipe__hw_prepare(&w, topo, desc);
    if (!res) {
        avgpipe__hw_domains(&w);
        res = avgpipe__hw_finish(&w, plan);
    }
    if (!res) avgpipe__hw_info(&w, topo, desc, plan);
    avgpipe__hw_free_work(&w);
    if (res) {
        avgpipe_hwloc_placement_free(plan);
        return res;
    }
    *out = plan;
    return AVGPIPE_OK;
}

AVGPIPE_API avgpipe_hwloc_placement_info avgpipe_hwloc_placement_query(const avgpipe_hwloc_placement *plan) {
    avgpipe_hwloc_placement_info none;
    if (plan) return plan->info;
    memset(&none, 0, sizeof none);
    return none;
}

static int avgpipe__hw_find(const avgpipe_hwloc_placement *plan, int rank) {
    int i;
    for (i = 0; plan && i < plan->info.count; i++)
        if (plan->place[i].rank == rank) return i;
    return -1;
}

AVGPIPE_API const avgpipe_hwloc_place *avgpipe_hwloc_placement_rank(const avgpipe_hwloc_placement *plan, int rank) {
    int i = avgpipe__hw_find(plan, rank);
    return i < 0 ? NULL : &plan->place[i];
}

/* The planned set of (rank, role), or NULL with the error recorded. */
static hwloc_const_bitmap_t avgpipe__hw_set_of(avgpipe_context *ctx, const avgpipe_hwloc_placement *plan, int rank, int role, const char *fn) {
    int i = avgpipe__hw_find(plan, rank);
    if (!plan) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: plan is NULL", fn), (hwloc_const_bitmap_t)NULL;
    if (i < 0) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: rank %d is not in the placement", fn, rank), (hwloc_const_bitmap_t)NULL;
    if (role != AVGPIPE_THREAD_WORKER && role != AVGPIPE_THREAD_AVERAGING && role != AVGPIPE_HWLOC_ROLE_RANK)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: role %d (worker %d, averaging %d, rank %d)", fn, role, AVGPIPE_THREAD_WORKER,
                                 AVGPIPE_THREAD_AVERAGING, AVGPIPE_HWLOC_ROLE_RANK),
               (hwloc_const_bitmap_t)NULL;
    return plan->set[3 * i + (role == AVGPIPE_HWLOC_ROLE_RANK ? 2 : role == AVGPIPE_THREAD_AVERAGING ? 1 : 0)];
}

AVGPIPE_API avgpipe_result avgpipe_hwloc_placement_cpuset(avgpipe_context *ctx, const avgpipe_hwloc_placement *plan, int rank, int role,
                                                     hwloc_bitmap_t out) {
    hwloc_const_bitmap_t s = avgpipe__hw_set_of(ctx, plan, rank, role, "avgpipe_hwloc_placement_cpuset");
    if (!s) return AVGPIPE_INVALID_ARG;
    if (!out) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_cpuset: out is NULL");
    return hwloc_bitmap_copy(out, s) == 0 ? AVGPIPE_OK : avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "avgpipe_hwloc_placement_cpuset: out of memory");
}

/* ---- binding ------------------------------------------------------------------------------------ */

static avgpipe_result avgpipe__hw_bind(avgpipe_context *ctx, const avgpipe_hwloc_placement *plan, int rank, int role, int flags, const char *fn) {
    hwloc_const_bitmap_t s = avgpipe__hw_set_of(ctx, plan, rank, role, fn);
    char cpus[AVGPIPE_HWLOC_TEXT];
    if (!s) return AVGPIPE_INVALID_ARG;
    if (!plan->info.binds) return AVGPIPE_OK;
    if (!plan->topo->this_system)
        return avgpipe_set_error(ctx, AVGPIPE_UNSUPPORTED, "%s: rank %d: the placement's topology is not this machine's (loaded from XML): nothing to bind",
                                 fn, rank);
    if (hwloc_set_cpubind(plan->topo->t, s, flags) == 0) return AVGPIPE_OK;
    avgpipe__hw_list(cpus, sizeof cpus, s);
    return avgpipe_set_error(ctx, AVGPIPE_BACKEND_ERROR, "%s: rank %d: hwloc_set_cpubind(%s) failed: %s", fn, rank, cpus, strerror(errno));
}

AVGPIPE_API avgpipe_result avgpipe_hwloc_bind(avgpipe_context *ctx, const avgpipe_hwloc_placement *plan, int rank, int role) {
    return avgpipe__hw_bind(ctx, plan, rank, role, HWLOC_CPUBIND_THREAD, "avgpipe_hwloc_bind");
}

AVGPIPE_API avgpipe_result avgpipe_hwloc_bind_process(avgpipe_context *ctx, const avgpipe_hwloc_placement *plan, int rank) {
    return avgpipe__hw_bind(ctx, plan, rank, AVGPIPE_HWLOC_ROLE_RANK, HWLOC_CPUBIND_PROCESS, "avgpipe_hwloc_bind_process");
}

AVGPIPE_API int avgpipe_hwloc_bind_thread(int rank, int role, void *plan) {
    return (int)avgpipe_hwloc_bind(NULL, (const avgpipe_hwloc_placement *)plan, rank, role);
}

/* ---- the report --------------------------------------------------------------------------------- */

static avgpipe_result avgpipe__hw_printf(avgpipe_context *ctx, avgpipe_buf *out, const char *fmt, ...)
#if defined(__GNUC__) || defined(__clang__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static avgpipe_result avgpipe__hw_printf(avgpipe_context *ctx, avgpipe_buf *out, const char *fmt, ...) {
    char line[1024];
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_report: formatting failed");
    return avgpipe_buf_append(ctx, out, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

static const char *avgpipe__hw_nic_words(avgpipe_hwloc_nic_distance d) {
    switch (d) {
    case AVGPIPE_HWLOC_NIC_PIX: return "same PCIe bridge";
    case AVGPIPE_HWLOC_NIC_PXB: return "same PCIe switch";
    case AVGPIPE_HWLOC_NIC_PHB: return "same PCIe host bridge";
    case AVGPIPE_HWLOC_NIC_NODE: return "same NUMA node";
    case AVGPIPE_HWLOC_NIC_SYS: return "another NUMA node";
    default: return "";
    }
}

static avgpipe_result avgpipe__hw_report_rank(avgpipe_context *ctx, const avgpipe_hwloc_place *p, avgpipe_buf *out) {
    char gpu[64], nic[128];
    if (p->gpu[0] && p->gpu_numa >= 0)
        snprintf(gpu, sizeof gpu, "gpu %s%s%s (numa %d)", p->gpu, p->gpu_name[0] ? " " : "", p->gpu_name, p->gpu_numa);
    else if (p->gpu[0]) snprintf(gpu, sizeof gpu, "gpu %s%s%s", p->gpu, p->gpu_name[0] ? " " : "", p->gpu_name);
    else snprintf(gpu, sizeof gpu, "cpu");
    if (p->nic_distance == AVGPIPE_HWLOC_NIC_NONE) snprintf(nic, sizeof nic, "nic none");
    else
        snprintf(nic, sizeof nic, "nic %s %s (%s: %s)", p->nic[0] ? p->nic : "?", p->nic_pci, avgpipe_hwloc_nic_distance_name(p->nic_distance),
                 avgpipe__hw_nic_words(p->nic_distance));
    return avgpipe__hw_printf(ctx, out, "rank %d: %s; worker core%s %s (cpus %s)%s, averaging core %s (cpus %s)%s, numa %d; %s%s%s\n", p->rank, gpu,
                              strpbrk(p->worker_cores, ",-") ? "s" : "", p->worker_cores, p->worker_cpus, p->worker_shared ? " shared" : "",
                              p->avg_cores, p->avg_cpus, p->avg_shared ? " shared" : "", p->numa, nic, p->note[0] ? "; note: " : "", p->note);
}

AVGPIPE_API avgpipe_result avgpipe_hwloc_placement_report(avgpipe_context *ctx, const avgpipe_hwloc_placement *plan, avgpipe_buf *out) {
    const avgpipe_hwloc_placement_info *in;
    hwloc_topology_t t;
    avgpipe_result res;
    const char *mode, *why;
    int i;
    if (!plan || !out) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_hwloc_placement_report: %s is NULL", plan ? "out" : "plan");
    in = &plan->info, t = plan->topo->t;
    mode = in->bind == AVGPIPE_HWLOC_BIND_NONE ? "none" : in->bind == AVGPIPE_HWLOC_BIND_ALWAYS ? "always" : "auto";
    if (in->bind == AVGPIPE_HWLOC_BIND_NONE) why = "off: report only";
    else if (in->bind == AVGPIPE_HWLOC_BIND_ALWAYS) why = in->exclusive ? "on: every worker has cores of its own" : "on: as planned, shared cores too";
    else why = in->exclusive ? "on: every worker has cores of its own" : "off: workers would share cores, the threads stay unbound";
    res = avgpipe__hw_printf(ctx, out, "hwloc placement on %s (%s): %d package%s, %d NUMA node%s, %d cores, %d PUs; %d rank%s over %d core%s (cpus %s)\n",
                             in->machine, in->this_system ? "this machine" : "from XML", hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PACKAGE),
                             hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PACKAGE) == 1 ? "" : "s", hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE),
                             hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE) == 1 ? "" : "s", hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE),
                             hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU), in->count, in->count == 1 ? "" : "s", in->cores, in->cores == 1 ? "" : "s",
                             in->cpus);
    if (!res) res = avgpipe__hw_printf(ctx, out, "binding: %s -> %s\n", mode, why);
    for (i = 0; i < in->count && !res; i++) res = avgpipe__hw_report_rank(ctx, &plan->place[i], out);
    if (!res) res = avgpipe__hw_printf(ctx, out, "NICs are diagnostic: NCCL and MPI choose their own.\n");
    return res;
}

#ifdef __cplusplus
}
#endif
#endif /* AVGPIPE_HWLOC_IMPLEMENTATION */
