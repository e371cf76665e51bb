/* avgpipe_nccl.h — the NCCL comm backend for avgpipe.h: one rank per process, one GPU per rank, activations
   and gradients moved between GPUs by NCCL on the device's own streams.

   WHAT IT IS
   ----------
   An avgpipe_comm table (avgpipe.h, section 13) over NCCL point-to-point calls (ncclSend/ncclRecv) and
   collectives (ncclAllReduce, ncclAllGather), for avgpipe_run on CUDA devices: each pipeline rank is one
   process driving one GPU; between GPUs of one machine NCCL uses NVLink or PCIe, across machines the
   network. It implements every entry of the table, including the device-ordered isend_on/irecv_on that a
   run on a CUDA device (avgpipe_cuda.h) uses for activations and gradients, group_begin/group_end, and
   split + allreduce_sum for replica groups. Tested with NCCL 2.28 and CUDA 13; needs NCCL 2.18 or newer.

   CREATE
   ------
   Every rank needs the same ncclUniqueId. Three ways to agree on one, plus an existing communicator:

       #define AVGPIPE_IMPLEMENTATION            // in one .c file: every included header's implementation
       #include "avgpipe.h"
       #include "avgpipe_mpi.h"                  // optional: before avgpipe_nccl.h, for avgpipe_nccl_create_mpi
       #include "avgpipe_nccl.h"                 // -I/usr/local/cuda/include; link -lnccl -lcudart

       // (a) over MPI: rank 0 makes the id and broadcasts it (MPI_Ibcast, polled with the timeout).
       avgpipe_nccl_desc nd = {0};
       nd.device = AVGPIPE_NCCL_DEVICE_LOCAL;    // the node-local rank's GPU
       avgpipe_comm comm;
       if (avgpipe_nccl_create_mpi(&ctx, &nd, MPI_COMM_WORLD, &comm)) fail(avgpipe_last_error(&ctx));

       // (b) through a shared file (no MPI): rank 0 writes the id to a temporary name and renames it into
       //     place (readers never see half a file); the others poll for it with the timeout.
       nd.id_file = "/shared/job-42/nccl.id"; nd.file_token = "job-42"; nd.rank = r; nd.size = n;
       avgpipe_nccl_create(&ctx, &nd, &comm);

       // (c) you distributed the id yourself:       nd.id = &id;   nd.rank = r; nd.size = n;
       // (d) from your own communicator (not owned): nd.comm = c;  (rank, size and device from it)

       int me = avgpipe_nccl_rank(&comm);
       desc.comm = &comm; desc.local_ranks = &me; desc.local_count = 1; desc.device = &cuda_device;
       avgpipe_run_create(&ctx, &desc, &run); ... avgpipe_run_destroy(run);
       avgpipe_comm_destroy(&comm);              // before MPI_Finalize

   Creation is collective: every rank calls it within desc.timeout_s of the others. It creates three
   communicators (below), connects this rank to its neighbours (desc.peers; rank +-1 by default) and ends
   with a barrier, so a rank that is missing or cannot start is reported at creation, by every rank, within
   the timeout, and not at the first message. With the file, rank 0 removes the file once every rank has
   joined (a later job cannot read a stale id from it); a rank 0 that fails before it has an id writes a
   failure record instead, so the others fail at once with its text rather than at their timeout.

   ONE RANK PER PROCESS, ONE GPU PER RANK
   --------------------------------------
   NCCL refuses two ranks of one communicator on the same GPU: initialisation fails on both with
   ncclInvalidUsage ("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ..."); creation then
   returns AVGPIPE_BACKEND_ERROR with that text and a hint. Give every process its own GPU:
   desc.device = AVGPIPE_NCCL_DEVICE_LOCAL (the node-local rank, from MPI or the launcher's environment,
   modulo the GPUs the process sees), or CUDA_VISIBLE_DEVICES per process. To run several stages on one GPU,
   use one process with the in-process comm backend (avgpipe_run's default) and the CUDA device: the stages
   then share the GPU through streams, which is also AvgPipe's point (N pipelines filling one GPU). And one
   rank per process: ncclCommInitAll-style communicators over several GPUs of one process are not supported
   by this backend (`self` in every call is the process's rank).

   HOW THE RUNTIME USES IT
   -----------------------
   - Activations and gradients: isend_on / irecv_on with device buffers and two device events. The transfer
     waits on the device for `ready` (cudaStreamWaitEvent on the comm stream; nothing blocks the host),
     runs as ncclSend/ncclRecv on that stream, and `done` is recorded there after it; the consumer orders
     itself after `done`. test/wait on the request report completion on the device (they never block the
     device). The events are CUDA events: by default an avgpipe_device_event IS a cudaEvent_t (the CUDA
     device's handles are); desc.cuda_event converts other handles.
   - Groups: the runtime brackets the sends and receives it issues between two compute ops with
     group_begin/group_end. Two neighbours that each post a receive from the other before their own send
     would deadlock if each call ran on its own: an NCCL receive is a kernel that waits for its sender, and
     the send queued behind it on the same stream never starts. Inside a group the calls are queued and
     group_end issues them as one ncclGroupStart/ncclGroupEnd per communicator, where NCCL runs a group's
     sends and receives together. Calls outside a group are issued at once, each as its own NCCL group.
   - Directions: a message from a lower rank to a higher one travels on the "up" communicator and stream,
     from a higher rank to a lower one on the "down" communicator and stream (both ends see the same
     direction). With the usual loop placement (stage s on rank s) up carries the activations and down the
     gradients. The deadlock this avoids: ranks a < b, a sends activation m to b while b sends gradient k to
     a, in separate groups. On one stream per rank, a's stream holds [send m][recv k] and b's holds
     [send k][recv m]; a send larger than NCCL's internal buffers finishes only while its receive runs, so
     a's send waits for b's receive, queued behind b's send, which waits for a's receive, queued behind a's
     send: neither rank moves. On separate communicators and streams each direction flows on its own, and
     the two directions of a pair of neighbours never wait on each other. (The table's calls do not say
     whether a message is an activation or a gradient, and the runtime's tags are opaque; with interleaved
     or V placements some activations go "down" — e.g. rank S-1 to rank 0 — and the rule that matters for
     the deadlock, never both directions of a pair on one stream, still holds.) A third communicator and
     stream carry the collectives (barrier, allreduce_sum), so they never queue behind a transfer.
     Within one direction transfers run in posting order (one stream): a receive runs when its sender
     gets there and holds the transfers posted after it on that direction; post receives where the lowered
     schedule places them (the runtime does), not arbitrarily early.
   - Control messages (the runtime's agreement at creation, gathers, avgpipe_run_allreduce) use plain
     isend/irecv on host memory: the backend stages host buffers through device memory (below).
   - Replica groups: split (ncclCommSplit, color = members[0], key = the rank's index in members) gives each
     stage's D ranks their own table; the averaging thread calls allreduce_sum on it.

   SEMANTICS
   ---------
   - Tags: NCCL carries none, and this backend does not check tags or sizes on the wire. A receive matches
     the next send from its peer in posting order on that direction, exactly as the comm table and the
     validator define matching; a finished receive's status reports the tag and size it was posted with.
     Why no check: (1) the runtime's lowered schedule fixes every channel's sequence on both ends, and
     avgpipe_run_create refuses to start when the processes' schedules or sizes differ (its fingerprint);
     (2) NCCL neither loses nor reorders messages: a broken link is an error, not a gap; (3) after any
     failure, and after cancel, the communicators are aborted, so no message of a failed iteration can
     ever match a later receive; (4) a wire check would cost an extra transfer per message plus a copy
     back to the host, and could only report after the data had landed (consumers on the device may have
     used it already). A receive posted with a size other than the sender's is an error NCCL does not
     detect either: the transfer hangs (then times out) or leaves the buffer partly written. So the
     table sets exact_bytes: with desc.variable_bytes the runtime moves every activation and gradient
     at its boundary's maximum and sends the micro-batch's size after it as an 8-byte host message.
   - Plain isend/irecv take device memory (used in place) or host memory (staged: a send is copied to a
     device buffer before isend returns, so the host buffer may be reused at once; a receive lands in a
     device buffer and is copied into the host buffer by the test/wait that reports it finished). They order
     nothing against your streams: a device buffer must hold its data when isend is called (synchronise its
     producer first, or use isend_on). isend_on/irecv_on take device memory only (AVGPIPE_INVALID_ARG
     otherwise). Memory of another GPU is refused. Zero-byte messages move nothing (no NCCL call) and finish
     when `ready` has passed.
   - Waits: wait polls cudaEventQuery of the transfer's own completion event and ncclCommGetAsyncError of
     its communicator, spinning for desc.spin_us, then sleeping with a back-off up to desc.max_sleep_us,
     until the timeout (consuming each poll's "not ready": THREAD-SAFETY). AVGPIPE_TIMEOUT leaves the
     request pending (wait again, or cancel it). The backend's own copies (staged host buffers, the
     deterministic allreduce's gather) are waited for the same way, within desc.timeout_s or the call's
     timeout: nothing blocks in cudaStreamSynchronize. An NCCL
     error (ncclCommGetAsyncError, or a failing NCCL call) or a CUDA error aborts every communicator the
     table owns (ncclCommAbort) and reports the error, with ncclGetErrorString and ncclGetLastError's text
     (cudaGetErrorString for CUDA), through last_error; the request is released. After an abort, every
     pending and later call returns AVGPIPE_ABORTED (pending requests stay pending until cancel releases
     them, as with the other backends).
   - Creation, split and the enqueueing of transfers have no timeout argument: they use desc.timeout_s.
     The communicators are nonblocking (ncclConfig_t.blocking = 0), so no call of this backend ever waits
     inside NCCL: the first transfer between two ranks sets up their connection, which needs both ranks;
     group_end (or an ungrouped post) polls until NCCL has enqueued the transfers, at most desc.timeout_s,
     then fails with AVGPIPE_TIMEOUT and aborts. Connecting the neighbours at creation keeps this out of
     the first iteration (and away from any chance of a rank waiting to connect to a peer that first waits
     for it).
   - cancel: an NCCL operation, once enqueued, cannot be withdrawn, and leaving it would make it match the
     peer's next message. So cancel of a request that has not finished aborts the table (every later call
     returns AVGPIPE_ABORTED) and releases the request; cancel of a finished one just releases it. The
     runtime cancels only after a failure, when it aborts anyway. (A request still queued in an open group
     has not reached NCCL, but dropping it would desynchronise the channel all the same: it aborts too.)
   - abort: ncclCommAbort of the table's communicators (and, at their next call, of its splits'); this
     process's pending and later calls return AVGPIPE_ABORTED at once (waits are woken). Other processes
     are not told (NCCL has no message for it): their transfers with this rank fail when NCCL notices the
     broken connection (across machines) or at their own timeout (within one, over NVLink or PCIe).
   - barrier: ncclAllReduce of one int on the collective communicator, waited for with the timeout.
     allreduce_sum: ncclAllReduce(ncclFloat, ncclSum) in place on device memory (host memory is staged),
     returns when the sum is in buf. A collective that times out stays enqueued inside NCCL: the table is
     then broken, and later collectives fail at once with AVGPIPE_STATE_ERROR (abort and recreate).
   - Determinism of allreduce_sum: NCCL's order of additions depends on its algorithm (ring, tree,
     NVLink SHARP), protocol, channel count and the topology, chosen per message size and machine. Every
     rank gets the same bits (the sum is computed once and broadcast), and with the same NCCL version,
     ranks, GPUs, topology and environment (NCCL_ALGO, NCCL_PROTO, ...) runs repeat in practice, but NCCL
     does not promise it, and the bits differ from the in-process and MPI backends', which add in rank
     order. So replica averaging over NCCL is deterministic across runs only under those conditions, and
     never equal to a CPU run. desc.deterministic_allreduce = 1 makes it exact: an ncclAllGather of every
     rank's floats and a sum in rank order on the host, the same bits as the in-process and MPI backends
     on every run (it moves size x count floats over NCCL and the PCIe bus: for replica averaging every H
     rounds, off the critical path, usually affordable).
   - split: ncclCommSplit of each of the three communicators (color members[0], key: the rank's index),
     collective over this table's ranks like MPI_Comm_split; every rank of this table calls it, once per
     split, in the same order. The child is an independent table (the same device, its own streams) that
     sees its parent's abort; destroy it before its parent. Children connect lazily (no eager connection,
     no barrier at the split).
   - Concurrency on the GPU: the up, down and collective communicators' kernels run concurrently on the
     device. NCCL does not promise forward progress for kernels of several communicators on one GPU (each
     waits for its peers while holding its SMs); it works when they fit on the GPU together, which
     point-to-point kernels (a few blocks each) do on any data-centre GPU, as PyTorch's per-pair
     communicators rely on. Avoid device-wide synchronisation (cudaDeviceSynchronize, cudaMalloc/cudaFree
     of the default allocator) while transfers are pending; this backend makes none (its own buffers come
     from cudaMallocAsync on its streams).

   THREAD-SAFETY
   -------------
   As the comm table says: one rank's calls come from one thread at a time, and different tables (a table
   and its splits: the worker and the averaging thread) may be used from different threads at once. NCCL
   forbids issuing operations to communicators of one device from two threads at once: this backend
   serialises its NCCL calls with one process-wide mutex (never held while waiting). A group belongs to
   the thread that opened it: calls from that thread between group_begin and group_end are queued; another
   thread's group_begin on the same table meanwhile fails (AVGPIPE_STATE_ERROR). abort may be called from
   any thread at any time. Every entry makes the table's device current on the calling thread
   (cudaSetDevice). Creation, split and destroy: one thread, nothing else using the table.

   No CUDA error state is left behind in the threads the backend runs on. The CUDA runtime keeps a last
   error per host thread until cudaGetLastError reads it, and a query's cudaErrorNotReady counts as one:
   the waits consume it where cudaEventQuery or cudaStreamQuery answers it, and a CUDA error the backend
   reports (through last_error, with CUDA's text, as before) or ignores (freeing after a failure) is
   consumed as well. So after any call of the table, in the worker's thread, the averaging thread or any
   other, cudaGetLastError returns only what the caller's own CUDA calls left (a trainer's callback
   checking its launches does not see "device not ready"). A sticky error (a broken CUDA context) stays,
   as CUDA returns it from every later call. ncclCommGetAsyncError, which the waits poll too, reads
   NCCL's own state and no CUDA state.

   CONFIGURATION MACROS
   --------------------
     AVGPIPE_NCCL_IMPLEMENTATION  compile the implementation here (AVGPIPE_IMPLEMENTATION and AVGPIPE_IMPL
                                  turn it on too). Include <mpi.h> (or avgpipe_mpi.h) before this header in
                                  that translation unit to get avgpipe_nccl_create_mpi.
   Building: C11 or C++11 (also under nvcc), -I/usr/local/cuda/include, link -lnccl -lcudart -pthread.
   License: MIT, as avgpipe.h. */
#ifndef AVGPIPE_NCCL_H
#define AVGPIPE_NCCL_H

#ifndef AVGPIPE_H
#error "avgpipe_nccl.h: include avgpipe.h first"
#endif
#if AVGPIPE_VERSION_NUMBER != 1003 /* released together: 0.10.3 */
#error "avgpipe_nccl.h is version 0.10.3: include the avgpipe.h of the same release"
#endif

#include <cuda_runtime_api.h>
#include <nccl.h>

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < 21800
#error "avgpipe_nccl.h: needs NCCL 2.18 or newer (ncclCommSplit, nonblocking communicators, ncclGetLastError)"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* desc.device: the node-local rank (MPI_COMM_TYPE_SHARED under avgpipe_nccl_create_mpi, else the launcher's
   environment, see avgpipe_nccl_local_rank) modulo the number of GPUs this process sees. */
#define AVGPIPE_NCCL_DEVICE_LOCAL (-1)
#define AVGPIPE_NCCL_ID_BYTES 128  /* sizeof(ncclUniqueId) */
#define AVGPIPE_NCCL_TOKEN_MAX 63  /* bytes of a file token */

/* Zero-initialise; zero fields mean:
     id, id_file, comm   where the communicator comes from (avgpipe_nccl_create: exactly one of them;
                         avgpipe_nccl_create_mpi: none):
                           id       every rank passes the same ncclUniqueId (you distributed it);
                           id_file  rank 0 makes an id and writes it to this path, the others read it (a
                                    file system all ranks see; see avgpipe_nccl_id_file_write);
                           comm     an existing communicator: the backend splits its own three from it
                                    (collective over it) and never uses, aborts or destroys yours; rank,
                                    size and device are the communicator's.
     rank, size          this process's rank and the number of ranks (with id and id_file)
     device              0 -> CUDA device 0; AVGPIPE_NCCL_DEVICE_LOCAL -> the node-local rank's GPU
     timeout_s           0 -> 120: creation, split, enqueueing transfers (connection set-up), destroy
     peers, npeers       ranks to connect to at creation (symmetric: if a lists b, b lists a); NULL -> this
                         rank +- 1 (modulo size: the loop placement's neighbours). lazy_connect = 1: none.
     file_token          id_file: a string naming this job (<= 63 bytes; e.g. the scheduler's job id): a
                         file written with another token is ignored. NULL -> "".
     deterministic_allreduce  1: allreduce_sum adds in rank order (see SEMANTICS); 0: ncclAllReduce
     spin_us             0 -> 50: a wait polls without sleeping for this long
     max_sleep_us        0 -> 200: the longest sleep between two polls afterwards
     cuda_event          NULL -> an avgpipe_device_event is a cudaEvent_t; else it converts one (user:
                         cuda_event_user)                                                                 */
typedef struct avgpipe_nccl_desc {
    const ncclUniqueId *id;
    const char *id_file;
    ncclComm_t comm;
    int rank;
    int size;
    int device;
    double timeout_s;
    const int *peers;
    int npeers;
    int lazy_connect;
    const char *file_token;
    int deterministic_allreduce;
    double spin_us;
    double max_sleep_us;
    cudaEvent_t (*cuda_event)(avgpipe_device_event event, void *user);
    void *cuda_event_user;
} avgpipe_nccl_desc;

/* The resolved description (what zero fields became). Thread-safe. */
AVGPIPE_API avgpipe_nccl_desc avgpipe_nccl_query_defaults(const avgpipe_nccl_desc *desc);

/* Create the backend from desc->id, desc->id_file or desc->comm (exactly one). Collective: every rank calls
   it within desc->timeout_s of the others. Errors (the detail names the field, the rank, and CUDA's or
   NCCL's text): AVGPIPE_INVALID_ARG (a bad field, checked before anything else; a device this process does
   not see), AVGPIPE_BACKEND_ERROR (no usable GPU: CUDA's text; NCCL failed: NCCL's text, e.g. two ranks on
   one GPU), AVGPIPE_TIMEOUT (a rank did not join; the id file did not appear), AVGPIPE_IO_ERROR (the id
   file cannot be written), AVGPIPE_OUT_OF_MEMORY. On failure *out is zeroed and nothing is left allocated
   (what CUDA and NCCL keep for themselves aside). out->size is the number of ranks. Release with
   avgpipe_comm_destroy (before MPI_Finalize). Thread-safety: one thread; makes the device current on it. */
AVGPIPE_API avgpipe_result avgpipe_nccl_create(avgpipe_context *ctx, const avgpipe_nccl_desc *desc, avgpipe_comm *out);

#if defined(MPI_VERSION)
/* The same, with the id broadcast from rank 0 of `comm` over MPI (MPI_Ibcast, polled within desc->timeout_s);
   rank and size are the MPI communicator's (desc->rank, size, id, id_file and comm must be zero).
   AVGPIPE_NCCL_DEVICE_LOCAL uses the rank within MPI_COMM_TYPE_SHARED. Collective over `comm`; when any rank
   fails before NCCL's initialisation (no GPU, no id), every rank fails, naming the first that did. MPI must
   be initialised (avgpipe_mpi_init, or MPI_Init_thread). Declared when <mpi.h> was included before this
   header; define it in the implementation's translation unit the same way. */
AVGPIPE_API avgpipe_result avgpipe_nccl_create_mpi(avgpipe_context *ctx, const avgpipe_nccl_desc *desc, MPI_Comm comm,
                                                   avgpipe_comm *out);
#endif

/* This process's rank in a table made by avgpipe_nccl_create(_mpi) or its split; -1 for another table. */
AVGPIPE_API int avgpipe_nccl_rank(const avgpipe_comm *comm);
/* The CUDA device of such a table; -1 for another table. */
AVGPIPE_API int avgpipe_nccl_device(const avgpipe_comm *comm);

/* The node-local rank from the launcher's environment (Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, MPICH's
   MPI_LOCALRANKID, MVAPICH's MV2_COMM_WORLD_LOCAL_RANK, Slurm's SLURM_LOCALID, torchrun's LOCAL_RANK,
   PMI_LOCAL_RANK: the first one set), or -1. Thread-safe. */
AVGPIPE_API int avgpipe_nccl_local_rank(void);

/* ---- The id file (no NCCL, no CUDA: usable and testable anywhere) ----------------------------------
   One record: a magic line, a format version, the number of ranks, the writer's clock (seconds since
   the epoch), a token naming the job, and either the id (`bytes` bytes) or a failure text, then an FNV-1a
   checksum of all of it. The file is read by the same architecture that wrote it (one cluster).

   avgpipe_nccl_id_file_write (rank 0) writes the record to a fresh temporary name in the same directory
   ("<path>.tmp-<unique>", created exclusively) and renames it over `path`: rename is atomic, so a reader
   sees the old file, no file, or the whole new one, never part of one (on NFS too: the rename is one
   operation on the server). With `failure` non-NULL it writes a failure record instead of the id (then id
   may be NULL). token NULL means "". Errors: AVGPIPE_INVALID_ARG (path NULL or empty, nranks < 1, bytes 0 or
   over 4096 without failure, token over AVGPIPE_NCCL_TOKEN_MAX bytes), AVGPIPE_IO_ERROR naming the path and
   the system's reason (the temporary file is removed).

   avgpipe_nccl_id_file_read (every other rank) polls `path` (every 10 ms, then up to every 100 ms) until
   it holds a record that is whole (magic, version, length, checksum), for the same nranks, token and
   bytes, and written no earlier than max_age_s seconds before this call started (max_age_s <= 0: any
   age); then copies the id into `id` and returns AVGPIPE_OK. Anything else there is ignored (rank 0 may
   still replace it) until timeout_s (0: look once) has passed: AVGPIPE_TIMEOUT then, the detail saying
   what it last saw (no file, a damaged file, a stale one and its age, another job's token, another rank
   count). A failure record returns AVGPIPE_BACKEND_ERROR at once with rank 0's text. avgpipe_nccl_create
   passes max_age_s = timeout_s + 10: rank 0 waits no longer than timeout_s for the others, so an older file
   is from an earlier job. Both: thread-safe (they touch only the file and ctx). */
AVGPIPE_API avgpipe_result avgpipe_nccl_id_file_write(avgpipe_context *ctx, const char *path, const char *token, int nranks,
                                                      const void *id, size_t bytes, const char *failure);
AVGPIPE_API avgpipe_result avgpipe_nccl_id_file_read(avgpipe_context *ctx, const char *path, const char *token, int nranks,
                                                     void *id, size_t bytes, double timeout_s, double max_age_s);

#ifdef __cplusplus
}
#endif
#endif /* AVGPIPE_NCCL_H */

/* ============================================================================================ */
/* Implementation                                                                                */
/* ============================================================================================ */
#if (defined(AVGPIPE_NCCL_IMPLEMENTATION) || defined(AVGPIPE_IMPLEMENTATION) || defined(AVGPIPE_IMPL)) && \
    !defined(AVGPIPE_NCCL_IMPLEMENTATION_INCLUDED)
#define AVGPIPE_NCCL_IMPLEMENTATION_INCLUDED

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

#define AVGPIPE__NCCL_MAGIC 0x6e63636cu
#define AVGPIPE__NCCL_UP 0   /* messages from a lower rank to a higher one */
#define AVGPIPE__NCCL_DOWN 1 /* from a higher rank to a lower one */
#define AVGPIPE__NCCL_COLL 2 /* barrier, allreduce_sum */
#define AVGPIPE__NCCL_NCOMM 3
#define AVGPIPE__NCCL_POOL 64     /* completion events kept for reuse */
#define AVGPIPE__NCCL_SCRATCH 64  /* device bytes: the barrier's int, the connection probes' bytes */

#if defined(__GNUC__) || defined(__clang__)
#define AVGPIPE__NCCL_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define AVGPIPE__NCCL_PRINTF(a, b)
#endif

/* NCCL must not be entered from two threads at once for communicators of one device; one lock for every
   table of the process. Held only around NCCL calls that return at once (the communicators are
   nonblocking), never while waiting. */
static pthread_mutex_t avgpipe__nccl_issue_mu = PTHREAD_MUTEX_INITIALIZER;

typedef struct avgpipe__nccl avgpipe__nccl;
typedef struct avgpipe__nccl_req avgpipe__nccl_req;

struct avgpipe__nccl_req {
    avgpipe__nccl_req *prev, *next; /* the table's live requests (destroy reclaims them) */
    avgpipe__nccl_req *qnext;       /* the open group's queue, in posting order */
    int send, peer, dir, queued;    /* queued: waiting for group_end (not in NCCL yet) */
    uint32_t tag;
    size_t bytes;
    void *nbuf;         /* what NCCL reads or writes: the caller's device buffer or the bounce buffer */
    void *host;         /* a staged receive's host buffer (filled when it finishes) */
    void *bounce;       /* device buffer of a staged transfer (cudaMallocAsync) */
    cudaEvent_t done;   /* ours: recorded after the transfer; test/wait query it */
    cudaEvent_t done_user; /* the caller's `done` (isend_on/irecv_on), or NULL */
};

struct avgpipe__nccl {
    unsigned magic;
    avgpipe_nccl_desc desc; /* resolved; the pointers in it are not kept */
    avgpipe_allocator alloc;
    int rank, size, device;
    ncclComm_t comm[AVGPIPE__NCCL_NCOMM]; /* NULL once aborted (ncclCommAbort frees them) */
    cudaStream_t stream[AVGPIPE__NCCL_NCOMM];
    cudaStream_t staging;   /* copies of host buffers to and from the bounce buffers */
    cudaEvent_t coll_done;  /* the last collective */
    unsigned char *scratch; /* AVGPIPE__NCCL_SCRATCH + size device bytes */
    avgpipe__nccl *parent;  /* a split's parent: its abort counts here too */
    pthread_mutex_t mu;     /* the fields below */
    pthread_cond_t cv;      /* sleeping waits; abort wakes them */
    int aborted, broken;    /* broken: a collective timed out and is still inside NCCL */
    int group_depth;
    pthread_t group_owner;
    avgpipe__nccl_req *queue_head, *queue_tail;
    avgpipe__nccl_req *live;
    cudaEvent_t pool[AVGPIPE__NCCL_POOL];
    int npool;
    char abort_msg[256];
    char err[768];
};

/* ---- time and sleeping ---- */

static double avgpipe__nccl_now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Sleep `us` microseconds on cv (mu held by the caller): an abort's broadcast ends it early. */
static void avgpipe__nccl_timedwait(pthread_cond_t *cv, pthread_mutex_t *mu, double us) {
    struct timespec ts;
    long long ns = (long long)(us * 1e3);
    timespec_get(&ts, TIME_UTC);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec += (long)(ns % 1000000000LL);
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(cv, mu, &ts);
}

/* One step of a poll loop that started at t0: spin for spin_us, then sleep with a growing back-off. */
static void avgpipe__nccl_nap(avgpipe__nccl *m, double t0, double *sleep_us) {
    if ((avgpipe__nccl_now() - t0) * 1e6 < m->desc.spin_us) return;
    pthread_mutex_lock(&m->mu);
    if (!m->aborted) avgpipe__nccl_timedwait(&m->cv, &m->mu, *sleep_us);
    pthread_mutex_unlock(&m->mu);
    *sleep_us = *sleep_us * 2 < m->desc.max_sleep_us ? *sleep_us * 2 : m->desc.max_sleep_us;
}

/* ---- errors ---- */

/* "rank R: <text>" as the table's last error; returns r. */
static avgpipe_result avgpipe__nccl_errf(avgpipe__nccl *m, avgpipe_result r, const char *fmt, ...) AVGPIPE__NCCL_PRINTF(3, 4);
static avgpipe_result avgpipe__nccl_errf(avgpipe__nccl *m, avgpipe_result r, const char *fmt, ...) {
    char text[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&m->mu);
    snprintf(m->err, sizeof m->err, "rank %d: %s", m->rank, text);
    pthread_mutex_unlock(&m->mu);
    return r;
}

/* CUDA keeps a last error per host thread, set by every runtime call that returns one (cudaErrorNotReady
   from cudaStreamQuery and cudaEventQuery too) until cudaGetLastError reads it. e is the result of a call
   this backend just made on the calling thread: when it is an error, consume it, so that the thread's next
   cudaGetLastError (a trainer's callback checking its own launches) does not see "device not ready" from
   our polling, or a failure we reported (or chose to ignore) already. A sticky error stays: CUDA returns
   it from every later call. */
static void avgpipe__nccl_forget(cudaError_t e) {
    if (e != cudaSuccess) (void)cudaGetLastError();
}

/* Has the work before ev finished? cudaEventQuery without leaving its "not ready" (or an error) behind. */
static int avgpipe__nccl_event_done(cudaEvent_t ev) {
    cudaError_t e = cudaEventQuery(ev);
    avgpipe__nccl_forget(e);
    return e == cudaSuccess;
}

/* CUDA's text for e after `what`, as the last error: AVGPIPE_BACKEND_ERROR. The thread's CUDA error is
   consumed: it is reported here. */
static avgpipe_result avgpipe__nccl_cuda_error(avgpipe__nccl *m, cudaError_t e, const char *what) {
    avgpipe__nccl_forget(e);
    return avgpipe__nccl_errf(m, AVGPIPE_BACKEND_ERROR, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/* NCCL's text for r after `what` (detail: ncclGetLastError, read by the caller before any abort). */
static avgpipe_result avgpipe__nccl_nccl_error(avgpipe__nccl *m, ncclResult_t r, const char *detail, const char *what) {
    const char *hint = "";
    if (detail && (strstr(detail, "Duplicate GPU") || strstr(detail, "duplicate GPU")))
        hint = " (NCCL refuses two ranks of one communicator on one GPU: give every process its own device, e.g. "
               "desc.device = AVGPIPE_NCCL_DEVICE_LOCAL or CUDA_VISIBLE_DEVICES; for several stages on one GPU use one "
               "process and the in-process comm)";
    return avgpipe__nccl_errf(m, AVGPIPE_BACKEND_ERROR, "%s: %s%s%.300s%s", what, ncclGetErrorString(r), detail && detail[0] ? ": " : "",
                              detail ? detail : "", hint);
}

/* Abort: ncclCommAbort of every communicator the table owns, wake every waiting thread; pending and later
   calls return AVGPIPE_ABORTED. Idempotent. */
static void avgpipe__nccl_kill(avgpipe__nccl *m, const char *why) {
    ncclComm_t c[AVGPIPE__NCCL_NCOMM];
    int i, first;
    pthread_mutex_lock(&avgpipe__nccl_issue_mu); /* no NCCL call of ours is using them */
    pthread_mutex_lock(&m->mu);
    first = !m->aborted;
    if (first) {
        m->aborted = 1;
        snprintf(m->abort_msg, sizeof m->abort_msg, "rank %d: aborted: %.220s", m->rank, why ? why : "");
        for (i = 0; i < AVGPIPE__NCCL_NCOMM; i++) c[i] = m->comm[i], m->comm[i] = NULL;
        pthread_cond_broadcast(&m->cv);
    }
    pthread_mutex_unlock(&m->mu);
    if (first) {
        if (m->device >= 0) avgpipe__nccl_forget(cudaSetDevice(m->device));
        for (i = 0; i < AVGPIPE__NCCL_NCOMM; i++)
            if (c[i]) ncclCommAbort(c[i]);
    }
    pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
}

/* Has this table or an ancestor been aborted? A parent's abort aborts this table's communicators too. */
static int avgpipe__nccl_dead(avgpipe__nccl *m) {
    avgpipe__nccl *p;
    int dead;
    char why[256];
    for (p = m->parent; p; p = p->parent) {
        pthread_mutex_lock(&p->mu);
        dead = p->aborted;
        if (dead) snprintf(why, sizeof why, "%s", p->abort_msg);
        pthread_mutex_unlock(&p->mu);
        if (dead) {
            avgpipe__nccl_kill(m, why);
            return 1;
        }
    }
    pthread_mutex_lock(&m->mu);
    dead = m->aborted;
    pthread_mutex_unlock(&m->mu);
    return dead;
}

/* Make the table's device current on the calling thread. */
static avgpipe_result avgpipe__nccl_use_device(avgpipe__nccl *m) {
    int cur = -1;
    cudaError_t e = cudaGetDevice(&cur);
    if (e == cudaSuccess && cur == m->device) return AVGPIPE_OK;
    avgpipe__nccl_forget(e);
    e = cudaSetDevice(m->device);
    return e == cudaSuccess ? AVGPIPE_OK : avgpipe__nccl_cuda_error(m, e, "cudaSetDevice");
}

/* Poll until none of the communicators in slots (read under the lock: abort clears them) is in progress:
   nonblocking NCCL returns ncclInProgress from initialisation, split, group end and finalize, and the work
   is done when ncclCommGetAsyncError says ncclSuccess. An error aborts the table (when abort_on_error). */
static avgpipe_result avgpipe__nccl_settle(avgpipe__nccl *m, ncclComm_t *const *slots, int n, double timeout_s, const char *what,
                                           int abort_on_error) {
    double t0 = avgpipe__nccl_now(), sleep_us = 1;
    for (;;) {
        ncclResult_t st = ncclSuccess, bad = ncclSuccess;
        char detail[320];
        int i, busy = 0, gone = 0;
        detail[0] = 0;
        pthread_mutex_lock(&avgpipe__nccl_issue_mu);
        for (i = 0; i < n && bad == ncclSuccess; i++) {
            ncclComm_t c = *slots[i];
            ncclResult_t q;
            if (!c) {
                gone = 1;
                break;
            }
            q = ncclCommGetAsyncError(c, &st);
            if (q != ncclSuccess) st = q;
            if (st == ncclInProgress) busy = 1;
            else if (st != ncclSuccess) bad = st, snprintf(detail, sizeof detail, "%s", ncclGetLastError(c));
        }
        pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
        if (gone || avgpipe__nccl_dead(m)) return AVGPIPE_ABORTED;
        if (bad != ncclSuccess) {
            avgpipe_result r = avgpipe__nccl_nccl_error(m, bad, detail, what);
            if (abort_on_error) avgpipe__nccl_kill(m, m->err);
            return r;
        }
        if (!busy) return AVGPIPE_OK;
        if (avgpipe__nccl_now() - t0 >= timeout_s) {
            avgpipe__nccl_errf(m, AVGPIPE_TIMEOUT, "%s: NCCL did not finish within %.3g s (is every rank running, with the same id, "
                                                   "and does each peer post the matching call?)", what, timeout_s);
            if (abort_on_error) avgpipe__nccl_kill(m, m->err);
            return AVGPIPE_TIMEOUT;
        }
        avgpipe__nccl_nap(m, t0, &sleep_us);
    }
}

/* Wait for event ev (recorded after work on communicator `which`) within timeout_s, watching that
   communicator's asynchronous errors. A CUDA or NCCL error aborts the table. */
static avgpipe_result avgpipe__nccl_wait_event(avgpipe__nccl *m, cudaEvent_t ev, int which, double timeout_s, const char *what) {
    double t0 = avgpipe__nccl_now(), sleep_us = 1;
    for (;;) {
        cudaError_t e = cudaEventQuery(ev);
        ncclResult_t st = ncclSuccess;
        char detail[320];
        avgpipe__nccl_forget(e); /* not ready is an answer; an error is reported below from e */
        if (avgpipe__nccl_dead(m)) return AVGPIPE_ABORTED;
        if (e == cudaSuccess) return AVGPIPE_OK;
        if (e != cudaErrorNotReady) {
            avgpipe_result r = avgpipe__nccl_cuda_error(m, e, what);
            avgpipe__nccl_kill(m, m->err);
            return r;
        }
        detail[0] = 0;
        pthread_mutex_lock(&avgpipe__nccl_issue_mu);
        if (m->comm[which] && ncclCommGetAsyncError(m->comm[which], &st) == ncclSuccess && st != ncclSuccess && st != ncclInProgress)
            snprintf(detail, sizeof detail, "%s", ncclGetLastError(m->comm[which]));
        pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
        if (st != ncclSuccess && st != ncclInProgress) {
            avgpipe_result r = avgpipe__nccl_nccl_error(m, st, detail, what);
            avgpipe__nccl_kill(m, m->err);
            return r;
        }
        if (avgpipe__nccl_now() - t0 >= timeout_s) return AVGPIPE_TIMEOUT;
        avgpipe__nccl_nap(m, t0, &sleep_us);
    }
}

/* Wait for the work queued on stream s (our own copies and frees, never queued behind an NCCL call) within
   timeout_s, polling cudaStreamQuery: no wait of this backend is unbounded, even on a GPU that hangs. */
static avgpipe_result avgpipe__nccl_drain(avgpipe__nccl *m, cudaStream_t s, double timeout_s, const char *what) {
    double t0 = avgpipe__nccl_now(), sleep_us = 1;
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) return AVGPIPE_OK;
        if (e != cudaErrorNotReady) return avgpipe__nccl_cuda_error(m, e, what);
        avgpipe__nccl_forget(e); /* not ready is an answer */
        if (avgpipe__nccl_now() - t0 >= timeout_s)
            return avgpipe__nccl_errf(m, AVGPIPE_TIMEOUT, "%s: the GPU did not finish within %.3g s", what, timeout_s);
        avgpipe__nccl_nap(m, t0, &sleep_us);
    }
}

static cudaEvent_t avgpipe__nccl_cuda_event(avgpipe__nccl *m, avgpipe_device_event e) {
    if (!e) return NULL;
    return m->desc.cuda_event ? m->desc.cuda_event(e, m->desc.cuda_event_user) : (cudaEvent_t)(void *)e;
}

/* ---- completion events, requests ---- */

static avgpipe_result avgpipe__nccl_event_get(avgpipe__nccl *m, cudaEvent_t *out) {
    cudaError_t e;
    pthread_mutex_lock(&m->mu);
    *out = m->npool ? m->pool[--m->npool] : NULL;
    pthread_mutex_unlock(&m->mu);
    if (*out) return AVGPIPE_OK;
    e = cudaEventCreateWithFlags(out, cudaEventDisableTiming);
    if (e != cudaSuccess) *out = NULL;
    return e == cudaSuccess ? AVGPIPE_OK : avgpipe__nccl_cuda_error(m, e, "cudaEventCreateWithFlags");
}

static void avgpipe__nccl_event_put(avgpipe__nccl *m, cudaEvent_t ev) {
    if (!ev) return;
    pthread_mutex_lock(&m->mu);
    if (m->npool < AVGPIPE__NCCL_POOL) m->pool[m->npool++] = ev, ev = NULL;
    pthread_mutex_unlock(&m->mu);
    if (ev) avgpipe__nccl_forget(cudaEventDestroy(ev));
}

/* Unlink r (and take it out of the group queue), give back its event and bounce buffer, free it. */
static void avgpipe__nccl_release(avgpipe__nccl *m, avgpipe__nccl_req *r) {
    pthread_mutex_lock(&m->mu);
    if (r->prev) r->prev->next = r->next;
    else if (m->live == r) m->live = r->next;
    if (r->next) r->next->prev = r->prev;
    if (r->queued) {
        avgpipe__nccl_req **pp = &m->queue_head, *last = NULL;
        while (*pp && *pp != r) last = *pp, pp = &(*pp)->qnext;
        if (*pp) {
            *pp = r->qnext;
            if (m->queue_tail == r) m->queue_tail = last;
        }
    }
    pthread_mutex_unlock(&m->mu);
    if (r->bounce) avgpipe__nccl_forget(cudaFreeAsync(r->bounce, m->staging));
    avgpipe__nccl_event_put(m, r->done);
    m->alloc.free(r, m->alloc.user);
}

/* Where buf lives: 1 device memory of this table's GPU (or managed), 0 host memory; an error for another
   GPU's memory. */
static avgpipe_result avgpipe__nccl_memtype(avgpipe__nccl *m, const void *buf, int *device, const char *what) {
    struct cudaPointerAttributes a;
    cudaError_t e;
    memset(&a, 0, sizeof a);
    e = cudaPointerGetAttributes(&a, buf);
    if (e != cudaSuccess) { /* older CUDA: host memory the runtime does not know is an error; not sticky */
        avgpipe__nccl_forget(e);
        *device = 0;
        return AVGPIPE_OK;
    }
    *device = a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
    if (a.type == cudaMemoryTypeDevice && a.device != m->device)
        return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: the buffer is memory of CUDA device %d; this rank uses device %d", what,
                                  a.device, m->device);
    return AVGPIPE_OK;
}

/* ---- point to point ---- */

/* Enqueue the transfers of `list` (linked by qnext): per direction one NCCL group, then, once NCCL has
   enqueued them (nonblocking: polled), each transfer's completion events on that direction's stream. */
static avgpipe_result avgpipe__nccl_issue(avgpipe__nccl *m, avgpipe__nccl_req *list) {
    static const char *const what[2] = {"enqueueing transfers to higher ranks", "enqueueing transfers to lower ranks"};
    avgpipe__nccl_req *r;
    int dir;
    for (dir = AVGPIPE__NCCL_UP; dir <= AVGPIPE__NCCL_DOWN; dir++) {
        ncclResult_t nr = ncclSuccess, ne;
        int ops = 0, any = 0;
        char detail[320];
        avgpipe_result res;
        for (r = list; r; r = r->qnext) any |= r->dir == dir, ops += r->dir == dir && r->bytes > 0;
        if (!any) continue;
        if (ops) {
            detail[0] = 0;
            pthread_mutex_lock(&avgpipe__nccl_issue_mu);
            if (!m->comm[dir]) {
                pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
                return AVGPIPE_ABORTED;
            }
            nr = ncclGroupStart();
            for (r = list; r && (nr == ncclSuccess || nr == ncclInProgress); r = r->qnext)
                if (r->dir == dir && r->bytes > 0)
                    nr = r->send ? ncclSend(r->nbuf, r->bytes, ncclUint8, r->peer, m->comm[dir], m->stream[dir])
                                 : ncclRecv(r->nbuf, r->bytes, ncclUint8, r->peer, m->comm[dir], m->stream[dir]);
            ne = ncclGroupEnd(); /* always: the group must be closed */
            if (nr == ncclSuccess || nr == ncclInProgress) nr = ne;
            if (nr != ncclSuccess && nr != ncclInProgress) snprintf(detail, sizeof detail, "%s", ncclGetLastError(m->comm[dir]));
            pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
            if (nr != ncclSuccess && nr != ncclInProgress) {
                res = avgpipe__nccl_nccl_error(m, nr, detail, what[dir]);
                avgpipe__nccl_kill(m, m->err);
                return res;
            }
            {
                ncclComm_t *slot = &m->comm[dir];
                if ((res = avgpipe__nccl_settle(m, &slot, 1, m->desc.timeout_s, what[dir], 1)) != AVGPIPE_OK) return res;
            }
        }
        for (r = list; r; r = r->qnext) {
            cudaError_t e;
            if (r->dir != dir) continue;
            e = cudaEventRecord(r->done, m->stream[dir]);
            if (e == cudaSuccess && r->done_user) e = cudaEventRecord(r->done_user, m->stream[dir]);
            if (e != cudaSuccess) {
                res = avgpipe__nccl_cuda_error(m, e, "cudaEventRecord after a transfer");
                avgpipe__nccl_kill(m, m->err);
                return res;
            }
            pthread_mutex_lock(&m->mu);
            r->queued = 0;
            pthread_mutex_unlock(&m->mu);
        }
    }
    return AVGPIPE_OK;
}

/* Is a group open on m by the calling thread? (mu held) */
static int avgpipe__nccl_in_group(avgpipe__nccl *m) {
    return m->group_depth > 0 && pthread_equal(m->group_owner, pthread_self());
}

/* Stage a host buffer: a send's bytes are copied to a fresh device buffer (before this returns, so the
   host buffer is free again) and the direction's stream waits for the copy; a receive gets a device
   buffer, copied to the host when it finishes. */
static avgpipe_result avgpipe__nccl_stage(avgpipe__nccl *m, avgpipe__nccl_req *r, void *host) {
    cudaStream_t s = m->stream[r->dir];
    cudaError_t e = cudaMallocAsync(&r->bounce, r->bytes, r->send ? m->staging : s);
    if (e != cudaSuccess) {
        r->bounce = NULL;
        return avgpipe__nccl_cuda_error(m, e, "cudaMallocAsync (a device copy of a host buffer)");
    }
    r->nbuf = r->bounce;
    if (!r->send) {
        r->host = host;
        return AVGPIPE_OK;
    }
    e = cudaMemcpyAsync(r->bounce, host, r->bytes, cudaMemcpyHostToDevice, m->staging);
    if (e == cudaSuccess) e = cudaEventRecord(r->done, m->staging);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(s, r->done, 0);
    return e == cudaSuccess ? AVGPIPE_OK : avgpipe__nccl_cuda_error(m, e, "copying a host buffer to the device");
}

static avgpipe_result avgpipe__nccl_post(avgpipe__nccl *m, int send, int ordered, int self, int peer, void *buf, size_t bytes,
                                         uint32_t tag, avgpipe_device_event ready, avgpipe_device_event done, avgpipe_comm_request *out) {
    const char *what = send ? (ordered ? "isend_on" : "isend") : (ordered ? "irecv_on" : "irecv");
    avgpipe__nccl_req *r;
    avgpipe_result res;
    cudaEvent_t ready_c;
    int on_device = 1, grouped;
    if (!out) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: req is NULL", what);
    *out = NULL;
    if (self != m->rank) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: self is %d, but this process is rank %d", what, self, m->rank);
    if (peer < 0 || peer >= m->size || peer == self)
        return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: peer %d is not another rank of 0..%d", what, peer, m->size - 1);
    if (tag > AVGPIPE_COMM_TAG_MAX) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: tag %u is over AVGPIPE_COMM_TAG_MAX", what, (unsigned)tag);
    if (!buf && bytes) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: buf is NULL for %zu bytes", what, bytes);
    if (avgpipe__nccl_dead(m)) return AVGPIPE_ABORTED;
    if ((res = avgpipe__nccl_use_device(m)) != AVGPIPE_OK) return res;
    if (bytes && (res = avgpipe__nccl_memtype(m, buf, &on_device, what)) != AVGPIPE_OK) return res;
    if (!on_device && ordered)
        return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: buf is host memory; device-ordered transfers take device memory "
                                                          "(plain %s stages host buffers)", what, send ? "isend" : "irecv");
    r = (avgpipe__nccl_req *)m->alloc.alloc(sizeof *r, m->alloc.user);
    if (!r) return avgpipe__nccl_errf(m, AVGPIPE_OUT_OF_MEMORY, "%s: out of memory", what);
    memset(r, 0, sizeof *r);
    r->send = send, r->peer = peer, r->tag = tag, r->bytes = bytes, r->nbuf = buf;
    /* a message from src to dst travels "up" when src < dst, on both ends */
    r->dir = (send ? self < peer : peer < self) ? AVGPIPE__NCCL_UP : AVGPIPE__NCCL_DOWN;
    if ((res = avgpipe__nccl_event_get(m, &r->done)) != AVGPIPE_OK) {
        m->alloc.free(r, m->alloc.user);
        return res;
    }
    r->done_user = avgpipe__nccl_cuda_event(m, done);
    ready_c = avgpipe__nccl_cuda_event(m, ready);
    if (ready_c) {
        cudaError_t e = cudaStreamWaitEvent(m->stream[r->dir], ready_c, 0);
        if (e != cudaSuccess) res = avgpipe__nccl_cuda_error(m, e, "cudaStreamWaitEvent(ready)");
    }
    if (res == AVGPIPE_OK && bytes && !on_device) res = avgpipe__nccl_stage(m, r, buf);
    pthread_mutex_lock(&m->mu);
    r->next = m->live;
    if (m->live) m->live->prev = r;
    m->live = r;
    grouped = res == AVGPIPE_OK && avgpipe__nccl_in_group(m);
    if (grouped) {
        r->queued = 1;
        if (m->queue_tail) m->queue_tail->qnext = r;
        else m->queue_head = r;
        m->queue_tail = r;
    }
    pthread_mutex_unlock(&m->mu);
    if (res == AVGPIPE_OK && !grouped) res = avgpipe__nccl_issue(m, r);
    if (res != AVGPIPE_OK) { /* never reached NCCL, or the table is aborted now: nothing uses r */
        avgpipe__nccl_release(m, r);
        return res;
    }
    *out = (avgpipe_comm_request)(void *)r;
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__nccl_isend(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag,
                                          avgpipe_comm_request *req) {
    return avgpipe__nccl_post((avgpipe__nccl *)user, 1, 0, self, peer, (void *)(uintptr_t)buf, bytes, tag, NULL, NULL, req);
}
static avgpipe_result avgpipe__nccl_irecv(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag,
                                          avgpipe_comm_request *req) {
    return avgpipe__nccl_post((avgpipe__nccl *)user, 0, 0, self, peer, buf, bytes, tag, NULL, NULL, req);
}
static avgpipe_result avgpipe__nccl_isend_on(void *user, int self, int peer, const void *buf, size_t bytes, uint32_t tag,
                                             avgpipe_device_event ready, avgpipe_device_event done, avgpipe_comm_request *req) {
    return avgpipe__nccl_post((avgpipe__nccl *)user, 1, 1, self, peer, (void *)(uintptr_t)buf, bytes, tag, ready, done, req);
}
static avgpipe_result avgpipe__nccl_irecv_on(void *user, int self, int peer, void *buf, size_t bytes, uint32_t tag,
                                             avgpipe_device_event ready, avgpipe_device_event done, avgpipe_comm_request *req) {
    return avgpipe__nccl_post((avgpipe__nccl *)user, 0, 1, self, peer, buf, bytes, tag, ready, done, req);
}

/* A transfer that finished on the device: a staged receive's bytes go to the host, the status is filled,
   the request is released. */
static avgpipe_result avgpipe__nccl_finish(avgpipe__nccl *m, avgpipe__nccl_req *r, avgpipe_comm_status *status) {
    avgpipe_result res = AVGPIPE_OK;
    if (r->host && r->bytes) {
        static const char what[] = "copying a received message to its host buffer";
        cudaError_t e = cudaMemcpyAsync(r->host, r->bounce, r->bytes, cudaMemcpyDeviceToHost, m->staging);
        res = e == cudaSuccess ? avgpipe__nccl_drain(m, m->staging, m->desc.timeout_s, what) : avgpipe__nccl_cuda_error(m, e, what);
    }
    if (status && !r->send) status->tag = r->tag, status->bytes = r->bytes;
    avgpipe__nccl_release(m, r);
    return res;
}

static avgpipe_result avgpipe__nccl_check_req(avgpipe__nccl *m, int self, avgpipe__nccl_req *r, const char *what) {
    int mine;
    if (!r) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: req is NULL", what);
    if (self != m->rank) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: self is %d, but this process is rank %d", what, self, m->rank);
    pthread_mutex_lock(&m->mu);
    mine = r->queued && !m->aborted;
    pthread_mutex_unlock(&m->mu);
    if (mine) /* its group has not ended: it is not in NCCL, and nothing would ever finish it */
        return avgpipe__nccl_errf(m, AVGPIPE_STATE_ERROR, "%s: the transfer %s rank %d is in a group that has not ended (call group_end first)",
                                  what, r->send ? "to" : "from", r->peer);
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__nccl_test(void *user, int self, avgpipe_comm_request req, int *done, avgpipe_comm_status *status) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    avgpipe__nccl_req *r = (avgpipe__nccl_req *)(void *)req;
    avgpipe_result res;
    if (!done) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "test: done is NULL");
    *done = 0;
    if ((res = avgpipe__nccl_check_req(m, self, r, "test")) != AVGPIPE_OK) return res;
    if ((res = avgpipe__nccl_use_device(m)) != AVGPIPE_OK) return res;
    res = avgpipe__nccl_wait_event(m, r->done, r->dir, 0, "test");
    if (res == AVGPIPE_TIMEOUT) return AVGPIPE_OK; /* not yet */
    if (res == AVGPIPE_ABORTED) return res;       /* pending: cancel releases it */
    *done = 1;
    if (res != AVGPIPE_OK) {
        avgpipe__nccl_release(m, r);
        return res;
    }
    return avgpipe__nccl_finish(m, r, status);
}

static avgpipe_result avgpipe__nccl_wait(void *user, int self, avgpipe_comm_request req, double timeout_s, avgpipe_comm_status *status) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    avgpipe__nccl_req *r = (avgpipe__nccl_req *)(void *)req;
    avgpipe_result res;
    if ((res = avgpipe__nccl_check_req(m, self, r, "wait")) != AVGPIPE_OK) return res;
    if ((res = avgpipe__nccl_use_device(m)) != AVGPIPE_OK) return res;
    res = avgpipe__nccl_wait_event(m, r->done, r->dir, timeout_s, "wait");
    if (res == AVGPIPE_TIMEOUT)
        return avgpipe__nccl_errf(m, AVGPIPE_TIMEOUT, "the %zu-byte %s rank %d did not finish within %.3g s (is rank %d alive, and does it "
                                                      "post the matching %s?)", r->bytes, r->send ? "send to" : "receive from", r->peer,
                                  timeout_s, r->peer, r->send ? "receive" : "send");
    if (res == AVGPIPE_ABORTED) return res;
    if (res != AVGPIPE_OK) {
        avgpipe__nccl_release(m, r);
        return res;
    }
    return avgpipe__nccl_finish(m, r, status);
}

/* NCCL cannot withdraw an enqueued operation, and one left behind would meet the peer's next message:
   an unfinished request aborts the table. */
static void avgpipe__nccl_cancel(void *user, int self, avgpipe_comm_request req) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    avgpipe__nccl_req *r = (avgpipe__nccl_req *)(void *)req;
    int queued;
    (void)self;
    if (!r) return;
    avgpipe__nccl_use_device(m);
    pthread_mutex_lock(&m->mu);
    queued = r->queued;
    pthread_mutex_unlock(&m->mu);
    if (!avgpipe__nccl_dead(m) && (queued || !avgpipe__nccl_event_done(r->done))) {
        avgpipe__nccl_errf(m, AVGPIPE_ABORTED, "cancel of the unfinished %zu-byte %s rank %d: NCCL cannot withdraw an enqueued transfer, "
                                               "so the communicators were aborted", r->bytes, r->send ? "send to" : "receive from", r->peer);
        avgpipe__nccl_kill(m, m->err);
    }
    avgpipe__nccl_release(m, r);
}

static avgpipe_result avgpipe__nccl_group_begin(void *user, int self) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    avgpipe_result res = AVGPIPE_OK;
    if (self != m->rank) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "group_begin: self is %d, but this process is rank %d", self, m->rank);
    if (avgpipe__nccl_dead(m)) return AVGPIPE_ABORTED;
    pthread_mutex_lock(&m->mu);
    if (m->group_depth > 0 && !pthread_equal(m->group_owner, pthread_self())) res = AVGPIPE_STATE_ERROR;
    else if (m->group_depth++ == 0) m->group_owner = pthread_self();
    pthread_mutex_unlock(&m->mu);
    if (res) return avgpipe__nccl_errf(m, res, "group_begin: another thread has a group open on this communicator");
    return AVGPIPE_OK;
}

static avgpipe_result avgpipe__nccl_group_end(void *user, int self) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    avgpipe__nccl_req *list = NULL;
    int ok;
    if (self != m->rank) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "group_end: self is %d, but this process is rank %d", self, m->rank);
    pthread_mutex_lock(&m->mu);
    ok = avgpipe__nccl_in_group(m);
    if (ok && --m->group_depth == 0) list = m->queue_head, m->queue_head = m->queue_tail = NULL;
    pthread_mutex_unlock(&m->mu);
    if (!ok) return avgpipe__nccl_errf(m, AVGPIPE_STATE_ERROR, "group_end without a group_begin on this thread");
    if (!list) return avgpipe__nccl_dead(m) ? AVGPIPE_ABORTED : AVGPIPE_OK;
    if (avgpipe__nccl_dead(m)) return AVGPIPE_ABORTED; /* the queued requests stay pending: cancel releases them */
    {
        avgpipe_result res = avgpipe__nccl_use_device(m);
        if (res != AVGPIPE_OK) {
            avgpipe__nccl_kill(m, m->err);
            return res;
        }
    }
    return avgpipe__nccl_issue(m, list);
}

/* ---- collectives ---- */

static avgpipe_result avgpipe__nccl_check_coll(avgpipe__nccl *m, int self, const char *what) {
    int broken;
    if (self != m->rank) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "%s: self is %d, but this process is rank %d", what, self, m->rank);
    if (avgpipe__nccl_dead(m)) return AVGPIPE_ABORTED;
    pthread_mutex_lock(&m->mu);
    broken = m->broken;
    pthread_mutex_unlock(&m->mu);
    if (broken)
        return avgpipe__nccl_errf(m, AVGPIPE_STATE_ERROR, "%s: an earlier collective timed out and is still inside NCCL; the communicator "
                                                          "is unusable (abort it and create another)", what);
    return avgpipe__nccl_use_device(m);
}

/* After an enqueue call on the collective communicator: its error, or wait until NCCL enqueued it, then
   until it finished on the device (timeout_s). A timeout leaves it inside NCCL: the table is broken. */
static avgpipe_result avgpipe__nccl_coll_finish(avgpipe__nccl *m, ncclResult_t nr, const char *detail, double timeout_s, const char *what) {
    ncclComm_t *slot = &m->comm[AVGPIPE__NCCL_COLL];
    avgpipe_result res;
    cudaError_t e;
    if (nr != ncclSuccess && nr != ncclInProgress) {
        res = avgpipe__nccl_nccl_error(m, nr, detail, what);
        avgpipe__nccl_kill(m, m->err);
        return res;
    }
    if ((res = avgpipe__nccl_settle(m, &slot, 1, m->desc.timeout_s, what, 1)) != AVGPIPE_OK) return res;
    e = cudaEventRecord(m->coll_done, m->stream[AVGPIPE__NCCL_COLL]);
    if (e != cudaSuccess) {
        res = avgpipe__nccl_cuda_error(m, e, what);
        avgpipe__nccl_kill(m, m->err);
        return res;
    }
    res = avgpipe__nccl_wait_event(m, m->coll_done, AVGPIPE__NCCL_COLL, timeout_s, what);
    if (res == AVGPIPE_TIMEOUT) {
        pthread_mutex_lock(&m->mu);
        m->broken = 1;
        pthread_mutex_unlock(&m->mu);
        avgpipe__nccl_errf(m, AVGPIPE_TIMEOUT, "%s: not every rank joined within %.3g s (the communicator is now unusable)", what, timeout_s);
    }
    return res;
}

static avgpipe_result avgpipe__nccl_barrier(void *user, int self, double timeout_s) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    ncclResult_t nr;
    char detail[320];
    avgpipe_result res = avgpipe__nccl_check_coll(m, self, "barrier");
    if (res) return res;
    detail[0] = 0;
    pthread_mutex_lock(&avgpipe__nccl_issue_mu);
    if (!m->comm[AVGPIPE__NCCL_COLL]) {
        pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
        return AVGPIPE_ABORTED;
    }
    nr = ncclAllReduce(m->scratch, m->scratch, 1, ncclInt32, ncclSum, m->comm[AVGPIPE__NCCL_COLL], m->stream[AVGPIPE__NCCL_COLL]);
    if (nr != ncclSuccess && nr != ncclInProgress) snprintf(detail, sizeof detail, "%s", ncclGetLastError(m->comm[AVGPIPE__NCCL_COLL]));
    pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
    return avgpipe__nccl_coll_finish(m, nr, detail, timeout_s, "barrier");
}

/* Rank-order sum (deterministic_allreduce): every rank's floats (ncclAllGather), summed on the host in rank
   order, as the in-process and MPI backends do: the same bits everywhere, every run. */
static avgpipe_result avgpipe__nccl_allreduce_ordered(avgpipe__nccl *m, float *buf, const float *dbuf, int on_device, size_t count,
                                                      double timeout_s) {
    cudaStream_t s = m->stream[AVGPIPE__NCCL_COLL];
    size_t bytes = count * sizeof(float);
    float *all_d = NULL, *all_h = NULL;
    ncclResult_t nr;
    char detail[320];
    cudaError_t e;
    avgpipe_result res;
    if (count > ((size_t)-1) / sizeof(float) / (size_t)m->size)
        return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "allreduce_sum: %zu floats from %d ranks do not fit in memory", count, m->size);
    all_h = (float *)m->alloc.alloc(bytes * (size_t)m->size, m->alloc.user);
    if (!all_h) return avgpipe__nccl_errf(m, AVGPIPE_OUT_OF_MEMORY, "allreduce_sum: out of memory for %d x %zu floats", m->size, count);
    e = cudaMallocAsync((void **)&all_d, bytes * (size_t)m->size, s);
    if (e != cudaSuccess) {
        m->alloc.free(all_h, m->alloc.user);
        return avgpipe__nccl_cuda_error(m, e, "allreduce_sum: cudaMallocAsync");
    }
    detail[0] = 0;
    pthread_mutex_lock(&avgpipe__nccl_issue_mu);
    nr = m->comm[AVGPIPE__NCCL_COLL] ? ncclAllGather(dbuf, all_d, count, ncclFloat, m->comm[AVGPIPE__NCCL_COLL], s) : ncclInvalidUsage;
    if (nr != ncclSuccess && nr != ncclInProgress && m->comm[AVGPIPE__NCCL_COLL])
        snprintf(detail, sizeof detail, "%s", ncclGetLastError(m->comm[AVGPIPE__NCCL_COLL]));
    pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
    res = avgpipe__nccl_coll_finish(m, nr, detail, timeout_s, "allreduce_sum (ncclAllGather)");
    if (res == AVGPIPE_OK) {
        static const char what[] = "allreduce_sum: copying the gathered floats to the host";
        e = cudaMemcpyAsync(all_h, all_d, bytes * (size_t)m->size, cudaMemcpyDeviceToHost, s);
        res = e == cudaSuccess ? avgpipe__nccl_drain(m, s, timeout_s, what) : avgpipe__nccl_cuda_error(m, e, what);
    }
    if (res == AVGPIPE_OK) {
        float *sum = on_device ? all_h : buf; /* on the device: sum into rank 0's part, then copy it up */
        avgpipe_comm_sum_ranks(sum, all_h, count, m->size, count);
        if (on_device) {
            static const char what[] = "allreduce_sum: copying the sum to the device";
            e = cudaMemcpyAsync(buf, all_h, bytes, cudaMemcpyHostToDevice, s);
            res = e == cudaSuccess ? avgpipe__nccl_drain(m, s, timeout_s, what) : avgpipe__nccl_cuda_error(m, e, what);
        }
    }
    if (res != AVGPIPE_TIMEOUT) avgpipe__nccl_forget(cudaFreeAsync(all_d, s)); /* else NCCL may still write it */
    m->alloc.free(all_h, m->alloc.user);
    return res;
}

static avgpipe_result avgpipe__nccl_allreduce(void *user, int self, float *buf, size_t count, double timeout_s) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    cudaStream_t s;
    float *dbuf = buf;
    ncclResult_t nr;
    char detail[320];
    cudaError_t e;
    int on_device = 1;
    avgpipe_result res = avgpipe__nccl_check_coll(m, self, "allreduce_sum");
    if (res) return res;
    if (!buf && count) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "allreduce_sum: buf is NULL for %zu floats", count);
    if (count == 0) return AVGPIPE_OK;
    if (count > ((size_t)-1) / sizeof(float))
        return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "allreduce_sum: %zu floats do not fit in memory", count);
    if ((res = avgpipe__nccl_memtype(m, buf, &on_device, "allreduce_sum")) != AVGPIPE_OK) return res;
    s = m->stream[AVGPIPE__NCCL_COLL];
    if (!on_device) { /* host memory: through a device copy */
        e = cudaMallocAsync((void **)&dbuf, count * sizeof(float), s);
        if (e == cudaSuccess) {
            e = cudaMemcpyAsync(dbuf, buf, count * sizeof(float), cudaMemcpyHostToDevice, s);
            if (e != cudaSuccess) avgpipe__nccl_forget(cudaFreeAsync(dbuf, s));
        }
        if (e != cudaSuccess) return avgpipe__nccl_cuda_error(m, e, "allreduce_sum: copying host memory to the device");
    }
    if (m->desc.deterministic_allreduce) {
        res = avgpipe__nccl_allreduce_ordered(m, buf, dbuf, on_device, count, timeout_s);
        if (!on_device && res != AVGPIPE_TIMEOUT) avgpipe__nccl_forget(cudaFreeAsync(dbuf, s));
        return res;
    }
    detail[0] = 0;
    pthread_mutex_lock(&avgpipe__nccl_issue_mu);
    nr = m->comm[AVGPIPE__NCCL_COLL] ? ncclAllReduce(dbuf, dbuf, count, ncclFloat, ncclSum, m->comm[AVGPIPE__NCCL_COLL], s) : ncclInvalidUsage;
    if (nr != ncclSuccess && nr != ncclInProgress && m->comm[AVGPIPE__NCCL_COLL])
        snprintf(detail, sizeof detail, "%s", ncclGetLastError(m->comm[AVGPIPE__NCCL_COLL]));
    pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
    res = avgpipe__nccl_coll_finish(m, nr, detail, timeout_s, "allreduce_sum");
    if (!on_device && res == AVGPIPE_OK) {
        static const char what[] = "allreduce_sum: copying the sum to host memory";
        e = cudaMemcpyAsync(buf, dbuf, count * sizeof(float), cudaMemcpyDeviceToHost, s);
        res = e == cudaSuccess ? avgpipe__nccl_drain(m, s, timeout_s, what) : avgpipe__nccl_cuda_error(m, e, what);
    }
    if (!on_device && res != AVGPIPE_TIMEOUT) avgpipe__nccl_forget(cudaFreeAsync(dbuf, s));
    return res;
}

/* ---- abort, last error, destroy ---- */

static void avgpipe__nccl_abort(void *user, avgpipe_result why, const char *message) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    char text[240];
    snprintf(text, sizeof text, "%.180s (%.40s)", message ? message : "", avgpipe_result_string(why));
    avgpipe__nccl_kill(m, text);
}

static const char *avgpipe__nccl_last_error(void *user, int self) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    (void)self;
    return m->aborted && !m->err[0] ? m->abort_msg : m->err;
}

/* Free what the table holds on the device and the host. Its communicators are gone (aborted or
   destroyed) or were never made. */
static void avgpipe__nccl_free(avgpipe__nccl *m) {
    int i;
    while (m->live) avgpipe__nccl_release(m, m->live);
    for (i = 0; i < m->npool; i++) avgpipe__nccl_forget(cudaEventDestroy(m->pool[i]));
    m->npool = 0;
    if (m->coll_done) avgpipe__nccl_forget(cudaEventDestroy(m->coll_done));
    for (i = 0; i < AVGPIPE__NCCL_NCOMM; i++)
        if (m->stream[i]) avgpipe__nccl_forget(cudaStreamDestroy(m->stream[i]));
    if (m->staging) {
        if (m->scratch) avgpipe__nccl_forget(cudaFreeAsync(m->scratch, m->staging));
        (void)avgpipe__nccl_drain(m, m->staging, m->desc.timeout_s, "destroy"); /* the frees of the bounce buffers and scratch */
        avgpipe__nccl_forget(cudaStreamDestroy(m->staging));
    }
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    m->magic = 0;
    m->alloc.free(m, m->alloc.user);
}

/* Finalize and destroy each communicator (polled within the timeout), or abort them all when a transfer
   is still pending (finalize would wait for it) or finalizing fails. */
static void avgpipe__nccl_destroy(void *user) {
    avgpipe__nccl *m = (avgpipe__nccl *)user;
    avgpipe__nccl_req *r;
    int i, pending = 0;
    if (!m) return;
    if (m->device >= 0) avgpipe__nccl_forget(cudaSetDevice(m->device));
    pthread_mutex_lock(&m->mu);
    for (r = m->live; r && !pending; r = r->next) pending = r->queued || !avgpipe__nccl_event_done(r->done);
    pending |= m->broken || m->group_depth > 0;
    pthread_mutex_unlock(&m->mu);
    if (!pending && !avgpipe__nccl_dead(m)) {
        ncclComm_t *slots[AVGPIPE__NCCL_NCOMM];
        ncclResult_t nr = ncclSuccess;
        pthread_mutex_lock(&avgpipe__nccl_issue_mu);
        for (i = 0; i < AVGPIPE__NCCL_NCOMM; i++) {
            slots[i] = &m->comm[i];
            if (nr == ncclSuccess || nr == ncclInProgress) nr = ncclCommFinalize(m->comm[i]);
        }
        pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
        if ((nr == ncclSuccess || nr == ncclInProgress) &&
            avgpipe__nccl_settle(m, slots, AVGPIPE__NCCL_NCOMM, m->desc.timeout_s, "destroy (ncclCommFinalize)", 0) == AVGPIPE_OK) {
            pthread_mutex_lock(&avgpipe__nccl_issue_mu);
            for (i = 0; i < AVGPIPE__NCCL_NCOMM; i++) ncclCommDestroy(m->comm[i]), m->comm[i] = NULL;
            pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
        }
    }
    avgpipe__nccl_kill(m, "destroyed"); /* whatever is left (nothing after a clean finalize) */
    avgpipe__nccl_free(m);
}

/* ---- the id file ---- */

#define AVGPIPE__NCCL_FILE_MAGIC "AVGPIPE NCCL ID\n" /* 16 bytes, no NUL */
#define AVGPIPE__NCCL_FILE_VERSION 1u
#define AVGPIPE__NCCL_FILE_HEAD 104  /* magic, version, nranks, id bytes, failure bytes, stamp, token[64] */
#define AVGPIPE__NCCL_FILE_PAYLOAD 4096

static uint64_t avgpipe__nccl_fnv(const unsigned char *p, size_t n) {
    uint64_t h = 14695981039346656037ull;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

AVGPIPE_API avgpipe_result avgpipe_nccl_id_file_write(avgpipe_context *ctx, const char *path, const char *token, int nranks,
                                                      const void *id, size_t bytes, const char *failure) {
    unsigned char rec[AVGPIPE__NCCL_FILE_HEAD + AVGPIPE__NCCL_FILE_PAYLOAD + 8];
    char tmp[4200];
    uint32_t v32;
    size_t payload, len, tlen;
    double stamp = avgpipe__nccl_now();
    uint64_t sum;
    FILE *f = NULL;
    int attempt, err = 0;
    if (!token) token = "";
    tlen = strlen(token);
    if (!path || !path[0]) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_write: path is NULL or empty");
    if (nranks < 1) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_write: nranks must be >= 1 (is %d)", nranks);
    if (tlen > AVGPIPE_NCCL_TOKEN_MAX)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_write: the token has %zu bytes (at most %d)", tlen,
                                 AVGPIPE_NCCL_TOKEN_MAX);
    if (!failure && (!id || bytes == 0 || bytes > AVGPIPE__NCCL_FILE_PAYLOAD))
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_write: an id of %zu bytes at %p (1..%d bytes)", bytes,
                                 id, AVGPIPE__NCCL_FILE_PAYLOAD);
    if (strlen(path) > sizeof tmp - 40)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_write: the path is too long");
    payload = failure ? strlen(failure) : bytes;
    if (payload > AVGPIPE__NCCL_FILE_PAYLOAD) payload = AVGPIPE__NCCL_FILE_PAYLOAD;
    if (failure && payload == 0) failure = "(no reason given)", payload = strlen(failure);
    memset(rec, 0, sizeof rec);
    memcpy(rec, AVGPIPE__NCCL_FILE_MAGIC, 16);
    v32 = AVGPIPE__NCCL_FILE_VERSION, memcpy(rec + 16, &v32, 4);
    v32 = (uint32_t)nranks, memcpy(rec + 20, &v32, 4);
    v32 = failure ? 0u : (uint32_t)payload, memcpy(rec + 24, &v32, 4);
    v32 = failure ? (uint32_t)payload : 0u, memcpy(rec + 28, &v32, 4);
    memcpy(rec + 32, &stamp, 8);
    memcpy(rec + 40, token, tlen);
    memcpy(rec + AVGPIPE__NCCL_FILE_HEAD, failure ? (const void *)failure : id, payload);
    len = AVGPIPE__NCCL_FILE_HEAD + payload;
    sum = avgpipe__nccl_fnv(rec, len);
    memcpy(rec + len, &sum, 8);
    len += 8;
    /* A fresh name in the same directory (so that rename stays within one file system), created
       exclusively: two writers, or a leftover of a crashed one, never share it. */
    for (attempt = 0; attempt < 16 && !f; attempt++) {
        snprintf(tmp, sizeof tmp, "%s.tmp-%08lx%04x%02x", path, (unsigned long)((uint64_t)(stamp * 1e6) ^ (uint64_t)(uintptr_t)&stamp),
                 (unsigned)(rand() & 0xffff), (unsigned)attempt);
        f = fopen(tmp, "wbx");
        if (!f) err = errno;
        if (!f && err != EEXIST) break;
    }
    if (!f) return avgpipe_set_error(ctx, AVGPIPE_IO_ERROR, "avgpipe_nccl_id_file_write: cannot create %s: %s", tmp, strerror(err));
    if (fwrite(rec, 1, len, f) != len) err = errno ? errno : EIO;
    if (fclose(f) != 0 && !err) err = errno ? errno : EIO;
    if (err || rename(tmp, path) != 0) {
        if (!err) err = errno;
        remove(tmp);
        return avgpipe_set_error(ctx, AVGPIPE_IO_ERROR, "avgpipe_nccl_id_file_write: cannot write %s: %s", path, strerror(err));
    }
    return AVGPIPE_OK;
}

/* One look at the file: 0 the id is in `id`; 1 a failure record (text in why); -1 nothing usable yet
   (why says what is there). */
static int avgpipe__nccl_file_look(const char *path, const char *token, int nranks, void *id, size_t bytes, double t0, double max_age_s,
                                   char *why, size_t cap) {
    unsigned char rec[AVGPIPE__NCCL_FILE_HEAD + AVGPIPE__NCCL_FILE_PAYLOAD + 16];
    char tok[AVGPIPE_NCCL_TOKEN_MAX + 2];
    uint32_t version, n, idb, flen;
    uint64_t sum;
    double stamp;
    size_t got;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (errno == ENOENT) snprintf(why, cap, "no file yet");
        else snprintf(why, cap, "cannot open it: %s", strerror(errno));
        return -1;
    }
    got = fread(rec, 1, sizeof rec, f);
    fclose(f);
    if (got < AVGPIPE__NCCL_FILE_HEAD + 8 || memcmp(rec, AVGPIPE__NCCL_FILE_MAGIC, 16) != 0) {
        snprintf(why, cap, "a file that is not an avgpipe NCCL id (%zu bytes)", got);
        return -1;
    }
    memcpy(&version, rec + 16, 4), memcpy(&n, rec + 20, 4), memcpy(&idb, rec + 24, 4), memcpy(&flen, rec + 28, 4);
    memcpy(&stamp, rec + 32, 8);
    if (version != AVGPIPE__NCCL_FILE_VERSION) {
        snprintf(why, cap, "an id file of format version %u (this reads %u)", (unsigned)version, AVGPIPE__NCCL_FILE_VERSION);
        return -1;
    }
    if ((idb && flen) || idb > AVGPIPE__NCCL_FILE_PAYLOAD || flen > AVGPIPE__NCCL_FILE_PAYLOAD ||
        got != AVGPIPE__NCCL_FILE_HEAD + (size_t)idb + flen + 8) {
        snprintf(why, cap, "a damaged file (%zu bytes, not what its header says)", got);
        return -1;
    }
    memcpy(&sum, rec + got - 8, 8);
    if (sum != avgpipe__nccl_fnv(rec, got - 8)) {
        snprintf(why, cap, "a damaged file (its checksum does not match)");
        return -1;
    }
    memcpy(tok, rec + 40, AVGPIPE_NCCL_TOKEN_MAX + 1);
    tok[AVGPIPE_NCCL_TOKEN_MAX + 1] = 0;
    if ((int)n != nranks) {
        snprintf(why, cap, "a file for %u ranks (this job has %d)", (unsigned)n, nranks);
        return -1;
    }
    if (strcmp(tok, token) != 0) {
        snprintf(why, cap, "a file of another job (token \"%.64s\", this job's \"%.64s\")", tok, token);
        return -1;
    }
    if (max_age_s > 0 && stamp < t0 - max_age_s) {
        snprintf(why, cap, "a stale file, written %.1f s before this rank began to wait (more than %.3g s: an earlier job's?)", t0 - stamp,
                 max_age_s);
        return -1;
    }
    if (flen) {
        snprintf(why, cap, "%.*s", (int)flen, (const char *)rec + AVGPIPE__NCCL_FILE_HEAD);
        return 1;
    }
    if (idb != bytes) {
        snprintf(why, cap, "an id of %u bytes (expected %zu)", (unsigned)idb, bytes);
        return -1;
    }
    memcpy(id, rec + AVGPIPE__NCCL_FILE_HEAD, bytes);
    return 0;
}

AVGPIPE_API avgpipe_result avgpipe_nccl_id_file_read(avgpipe_context *ctx, const char *path, const char *token, int nranks,
                                                     void *id, size_t bytes, double timeout_s, double max_age_s) {
    double t0 = avgpipe__nccl_now(), sleep_ms = 10;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char why[512];
    int k;
    if (!token) token = "";
    if (!path || !path[0]) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_read: path is NULL or empty");
    if (nranks < 1) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_read: nranks must be >= 1 (is %d)", nranks);
    if (!id || bytes == 0 || bytes > AVGPIPE__NCCL_FILE_PAYLOAD)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_read: an id of %zu bytes at %p (1..%d bytes)", bytes, id,
                                 AVGPIPE__NCCL_FILE_PAYLOAD);
    if (!(timeout_s >= 0)) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_read: timeout_s must be >= 0");
    if (strlen(token) > AVGPIPE_NCCL_TOKEN_MAX)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "avgpipe_nccl_id_file_read: the token has more than %d bytes", AVGPIPE_NCCL_TOKEN_MAX);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&cv, NULL);
    for (;;) {
        k = avgpipe__nccl_file_look(path, token, nranks, id, bytes, t0, max_age_s, why, sizeof why);
        if (k >= 0 || avgpipe__nccl_now() - t0 >= timeout_s) break;
        pthread_mutex_lock(&mu);
        avgpipe__nccl_timedwait(&cv, &mu, sleep_ms * 1e3);
        pthread_mutex_unlock(&mu);
        sleep_ms = sleep_ms * 1.5 < 100 ? sleep_ms * 1.5 : 100;
    }
    pthread_mutex_destroy(&mu);
    pthread_cond_destroy(&cv);
    if (k == 0) return AVGPIPE_OK;
    if (k == 1) return avgpipe_set_error(ctx, AVGPIPE_BACKEND_ERROR, "avgpipe_nccl_id_file_read: %s: rank 0 failed: %s", path, why);
    return avgpipe_set_error(ctx, AVGPIPE_TIMEOUT, "avgpipe_nccl_id_file_read: %s: no usable id within %.3g s; last seen: %s", path, timeout_s,
                             why);
}

/* ---- creation ---- */

AVGPIPE_API avgpipe_nccl_desc avgpipe_nccl_query_defaults(const avgpipe_nccl_desc *desc) {
    avgpipe_nccl_desc d;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (d.timeout_s == 0) d.timeout_s = 120;
    if (d.spin_us == 0) d.spin_us = 50;
    if (d.max_sleep_us == 0) d.max_sleep_us = 200;
    if (!d.file_token) d.file_token = "";
    return d;
}

AVGPIPE_API int avgpipe_nccl_local_rank(void) {
    static const char *const names[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                                        "SLURM_LOCALID", "LOCAL_RANK", "PMI_LOCAL_RANK"};
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *v = getenv(names[i]);
        char *end = NULL;
        long r;
        if (!v || !v[0]) continue;
        r = strtol(v, &end, 10);
        if (end && !*end && r >= 0 && r < 1000000) return (int)r;
    }
    return -1;
}

/* The description's fields, before anything touches CUDA or NCCL. */
static avgpipe_result avgpipe__nccl_check_desc(avgpipe_context *ctx, const avgpipe_nccl_desc *d, int mpi, const char *fn) {
    int sources = (d->id != NULL) + (d->id_file != NULL) + (d->comm != NULL);
    if (mpi && sources) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->id, id_file and comm must be NULL (the id comes over MPI)", fn);
    if (!mpi && sources != 1)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: give exactly one of desc->id, desc->id_file and desc->comm (%d given)", fn, sources);
    if (d->id_file && !d->id_file[0]) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->id_file is empty", fn);
    if (!mpi && !d->comm) {
        if (d->size < 1) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->size must be >= 1 (is %d)", fn, d->size);
        if (d->rank < 0 || d->rank >= d->size)
            return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->rank %d is not in 0..%d", fn, d->rank, d->size - 1);
    }
    if (d->device < AVGPIPE_NCCL_DEVICE_LOCAL)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->device %d is neither a CUDA device nor AVGPIPE_NCCL_DEVICE_LOCAL", fn, d->device);
    if (!(d->timeout_s > 0)) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->timeout_s must be > 0 (0 -> 120 s)", fn);
    if (!(d->spin_us >= 0) || !(d->max_sleep_us > 0))
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->spin_us and desc->max_sleep_us must be >= 0", fn);
    if (d->npeers < 0 || (d->npeers > 0 && !d->peers))
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->peers is NULL for npeers %d (or npeers < 0)", fn, d->npeers);
    if (strlen(d->file_token) > AVGPIPE_NCCL_TOKEN_MAX)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->file_token has more than %d bytes", fn, AVGPIPE_NCCL_TOKEN_MAX);
    return AVGPIPE_OK;
}

static avgpipe__nccl *avgpipe__nccl_new(avgpipe_context *ctx, const avgpipe_nccl_desc *d) {
    avgpipe__nccl *m = (avgpipe__nccl *)avgpipe_alloc(ctx, sizeof *m);
    if (!m) return NULL;
    memset(m, 0, sizeof *m);
    m->magic = AVGPIPE__NCCL_MAGIC;
    m->desc = *d;
    m->desc.id = NULL, m->desc.id_file = NULL, m->desc.comm = NULL, m->desc.peers = NULL, m->desc.file_token = "";
    m->alloc = avgpipe_context_query(ctx).allocator;
    m->rank = d->rank, m->size = d->size, m->device = -1;
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    return m;
}

/* Creation failed: the detail goes to ctx; abort what NCCL made, free the rest. */
static avgpipe_result avgpipe__nccl_fail(avgpipe_context *ctx, avgpipe__nccl *m, avgpipe_result res, const char *fn) {
    if (m->err[0]) avgpipe_set_error(ctx, res, "%s: %s", fn, m->err);
    else avgpipe_set_error(ctx, res, "%s: rank %d: %s", fn, m->rank, avgpipe_result_string(res));
    avgpipe__nccl_kill(m, "creation failed");
    avgpipe__nccl_free(m);
    return res;
}

/* Pick and open the GPU: streams, the collectives' event, the scratch bytes. */
static avgpipe_result avgpipe__nccl_open_device(avgpipe__nccl *m, int local_rank) {
    int n = 0, dev = m->desc.device, i;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        avgpipe__nccl_forget(e);
        return avgpipe__nccl_errf(m, AVGPIPE_BACKEND_ERROR, "no usable CUDA device: cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e),
                                  cudaGetErrorName(e));
    }
    if (n < 1) return avgpipe__nccl_errf(m, AVGPIPE_BACKEND_ERROR, "no CUDA device");
    if (dev == AVGPIPE_NCCL_DEVICE_LOCAL) {
        if (local_rank < 0)
            return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "desc->device AVGPIPE_NCCL_DEVICE_LOCAL: no node-local rank in the environment "
                                                              "(OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, LOCAL_RANK, ...): set desc->device");
        dev = local_rank % n;
    }
    if (dev >= n)
        return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "desc->device %d: this process sees %d CUDA device%s (CUDA_VISIBLE_DEVICES?)", dev, n,
                                  n == 1 ? "" : "s");
    m->device = dev;
    if ((e = cudaSetDevice(dev)) != cudaSuccess) return avgpipe__nccl_cuda_error(m, e, "cudaSetDevice");
    for (i = 0; i < AVGPIPE__NCCL_NCOMM && e == cudaSuccess; i++) e = cudaStreamCreateWithFlags(&m->stream[i], cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&m->staging, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&m->coll_done, cudaEventDisableTiming);
    /* stream-ordered: nothing here waits for the rest of the device (a split is made while transfers run) */
    if (e == cudaSuccess) e = cudaMallocAsync((void **)&m->scratch, AVGPIPE__NCCL_SCRATCH + (size_t)m->size, m->staging);
    if (e == cudaSuccess) e = cudaMemsetAsync(m->scratch, 0, AVGPIPE__NCCL_SCRATCH + (size_t)m->size, m->staging);
    if (e != cudaSuccess) return avgpipe__nccl_cuda_error(m, e, "setting up streams and buffers");
    return avgpipe__nccl_drain(m, m->staging, m->desc.timeout_s, "setting up streams and buffers");
}

static ncclConfig_t avgpipe__nccl_config(void) {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = 0; /* every call returns at once; this backend polls, with its timeouts */
    return c;
}

/* The collective communicator from the id, polled until NCCL has set it up. */
static avgpipe_result avgpipe__nccl_init(avgpipe__nccl *m, ncclUniqueId id) {
    ncclConfig_t cfg = avgpipe__nccl_config();
    ncclComm_t *slot = &m->comm[AVGPIPE__NCCL_COLL];
    ncclResult_t nr;
    char detail[320];
    detail[0] = 0;
    pthread_mutex_lock(&avgpipe__nccl_issue_mu);
    nr = ncclCommInitRankConfig(slot, m->size, id, m->rank, &cfg);
    if (nr != ncclSuccess && nr != ncclInProgress) snprintf(detail, sizeof detail, "%s", ncclGetLastError(*slot));
    pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
    if (nr != ncclSuccess && nr != ncclInProgress) return avgpipe__nccl_nccl_error(m, nr, detail, "ncclCommInitRankConfig");
    return avgpipe__nccl_settle(m, &slot, 1, m->desc.timeout_s, "ncclCommInitRankConfig (every rank must join)", 0);
}

/* ncclCommSplit(parent, color, key) into *child, polled (the parent too: it is busy while splitting). */
static avgpipe_result avgpipe__nccl_split_one(avgpipe__nccl *m, ncclComm_t *parent, int color, int key, ncclComm_t *child, const char *what) {
    ncclConfig_t cfg = avgpipe__nccl_config();
    ncclComm_t *slots[2];
    ncclResult_t nr;
    char detail[320];
    detail[0] = 0;
    pthread_mutex_lock(&avgpipe__nccl_issue_mu);
    nr = *parent ? ncclCommSplit(*parent, color, key, child, &cfg) : ncclInvalidUsage;
    if (nr != ncclSuccess && nr != ncclInProgress) snprintf(detail, sizeof detail, "%s", ncclGetLastError(*parent));
    pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
    if (nr != ncclSuccess && nr != ncclInProgress) return avgpipe__nccl_nccl_error(m, nr, detail, what);
    slots[0] = child, slots[1] = parent;
    return avgpipe__nccl_settle(m, slots, *child ? 2 : 1, m->desc.timeout_s, what, 0);
}

/* One 1-byte transfer each way with every peer, so that the connections are set up now and not inside
   the first iteration. */
static avgpipe_result avgpipe__nccl_connect(avgpipe__nccl *m, const int *peers, int npeers) {
    unsigned char *want;
    cudaEvent_t ev[2] = {NULL, NULL};
    avgpipe_result res = AVGPIPE_OK;
    int i, p, dir, n = 0;
    if (m->size < 2) return AVGPIPE_OK;
    want = (unsigned char *)m->alloc.alloc((size_t)m->size, m->alloc.user);
    if (!want) return avgpipe__nccl_errf(m, AVGPIPE_OUT_OF_MEMORY, "out of memory");
    memset(want, 0, (size_t)m->size);
    if (!peers) {
        want[(m->rank + 1) % m->size] = 1;
        want[(m->rank + m->size - 1) % m->size] = 1;
    }
    for (i = 0; peers && i < npeers; i++) {
        if (peers[i] < 0 || peers[i] >= m->size) {
            m->alloc.free(want, m->alloc.user);
            return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "desc->peers[%d] = %d is not a rank of 0..%d", i, peers[i], m->size - 1);
        }
        want[peers[i]] = 1;
    }
    want[m->rank] = 0;
    for (p = 0; p < m->size; p++) n += want[p];
    for (dir = AVGPIPE__NCCL_UP; n && dir <= AVGPIPE__NCCL_DOWN && res == AVGPIPE_OK; dir++) {
        ncclComm_t *slot = &m->comm[dir];
        ncclResult_t nr, ne;
        char detail[320];
        cudaError_t e;
        detail[0] = 0;
        pthread_mutex_lock(&avgpipe__nccl_issue_mu);
        nr = ncclGroupStart();
        for (p = 0; p < m->size && (nr == ncclSuccess || nr == ncclInProgress); p++)
            if (want[p]) /* up: the lower rank sends; down: the higher one */
                nr = (dir == AVGPIPE__NCCL_UP ? m->rank < p : m->rank > p)
                         ? ncclSend(m->scratch + 8, 1, ncclUint8, p, *slot, m->stream[dir])
                         : ncclRecv(m->scratch + AVGPIPE__NCCL_SCRATCH + p, 1, ncclUint8, p, *slot, m->stream[dir]);
        ne = ncclGroupEnd();
        if (nr == ncclSuccess || nr == ncclInProgress) nr = ne;
        if (nr != ncclSuccess && nr != ncclInProgress) snprintf(detail, sizeof detail, "%s", ncclGetLastError(*slot));
        pthread_mutex_unlock(&avgpipe__nccl_issue_mu);
        if (nr != ncclSuccess && nr != ncclInProgress) res = avgpipe__nccl_nccl_error(m, nr, detail, "connecting to the neighbours");
        if (res == AVGPIPE_OK) res = avgpipe__nccl_settle(m, &slot, 1, m->desc.timeout_s, "connecting to the neighbours (desc.peers)", 0);
        if (res == AVGPIPE_OK) res = avgpipe__nccl_event_get(m, &ev[dir]);
        if (res == AVGPIPE_OK && (e = cudaEventRecord(ev[dir], m->stream[dir])) != cudaSuccess) res = avgpipe__nccl_cuda_error(m, e, "cudaEventRecord");
    }
    for (dir = AVGPIPE__NCCL_UP; dir <= AVGPIPE__NCCL_DOWN; dir++) {
        if (res == AVGPIPE_OK && ev[dir]) {
            res = avgpipe__nccl_wait_event(m, ev[dir], dir, m->desc.timeout_s, "connecting to the neighbours");
            if (res == AVGPIPE_TIMEOUT)
                avgpipe__nccl_errf(m, res, "connecting to the neighbours did not finish within %.3g s (is every neighbour running, and does "
                                           "each list this rank among its peers?)", m->desc.timeout_s);
        }
        avgpipe__nccl_event_put(m, ev[dir]);
    }
    m->alloc.free(want, m->alloc.user);
    return res;
}

static avgpipe_result avgpipe__nccl_split(void *user, int self, const int *members, int count, avgpipe_comm *out);

static void avgpipe__nccl_table(avgpipe__nccl *m, avgpipe_comm *out) {
    memset(out, 0, sizeof *out);
    out->name = "nccl";
    out->size = m->size;
    out->isend = avgpipe__nccl_isend;
    out->irecv = avgpipe__nccl_irecv;
    out->test = avgpipe__nccl_test;
    out->wait = avgpipe__nccl_wait;
    out->cancel = avgpipe__nccl_cancel;
    out->group_begin = avgpipe__nccl_group_begin;
    out->group_end = avgpipe__nccl_group_end;
    out->isend_on = avgpipe__nccl_isend_on;
    out->irecv_on = avgpipe__nccl_irecv_on;
    out->barrier = avgpipe__nccl_barrier;
    out->allreduce_sum = avgpipe__nccl_allreduce;
    out->split = avgpipe__nccl_split;
    out->abort = avgpipe__nccl_abort;
    out->last_error = avgpipe__nccl_last_error;
    out->destroy = avgpipe__nccl_destroy;
    out->user = m;
    out->exact_bytes = 1; /* NCCL receives need the sender's size */
}

/* After the collective communicator exists: the up and down ones, the connections, a barrier. */
static avgpipe_result avgpipe__nccl_complete(avgpipe__nccl *m, const int *peers, int npeers, int lazy) {
    avgpipe_result res;
    res = avgpipe__nccl_split_one(m, &m->comm[AVGPIPE__NCCL_COLL], 0, m->rank, &m->comm[AVGPIPE__NCCL_UP], "ncclCommSplit (up)");
    if (res == AVGPIPE_OK)
        res = avgpipe__nccl_split_one(m, &m->comm[AVGPIPE__NCCL_COLL], 0, m->rank, &m->comm[AVGPIPE__NCCL_DOWN], "ncclCommSplit (down)");
    if (res == AVGPIPE_OK && !lazy) res = avgpipe__nccl_connect(m, peers, npeers);
    if (res == AVGPIPE_OK) {
        res = avgpipe__nccl_barrier(m, m->rank, m->desc.timeout_s);
        if (res == AVGPIPE_TIMEOUT)
            avgpipe__nccl_errf(m, res, "the barrier ending creation: not every rank got there within %.3g s", m->desc.timeout_s);
    }
    return res;
}

/* The id through the file: rank 0 makes it and writes it (or its failure), the others read it. */
static avgpipe_result avgpipe__nccl_file_id(avgpipe__nccl *m, const avgpipe_nccl_desc *d, avgpipe_result res, ncclUniqueId *id) {
    avgpipe_context fctx;
    avgpipe_context_desc cd;
    memset(&cd, 0, sizeof cd);
    cd.allocator = m->alloc;
    avgpipe_context_init(&fctx, &cd);
    if (m->rank == 0) {
        avgpipe_result w;
        if (res == AVGPIPE_OK) {
            ncclResult_t nr = ncclGetUniqueId(id);
            if (nr != ncclSuccess) res = avgpipe__nccl_nccl_error(m, nr, ncclGetLastError(NULL), "ncclGetUniqueId");
        }
        w = avgpipe_nccl_id_file_write(&fctx, d->id_file, d->file_token, m->size, res == AVGPIPE_OK ? (const void *)id : NULL, sizeof *id,
                                       res == AVGPIPE_OK ? NULL : m->err);
        if (res != AVGPIPE_OK) return res;
        return w == AVGPIPE_OK ? w : avgpipe__nccl_errf(m, w, "%s", avgpipe_last_error(&fctx));
    }
    if (res != AVGPIPE_OK) return res;
    res = avgpipe_nccl_id_file_read(&fctx, d->id_file, d->file_token, m->size, id, sizeof *id, d->timeout_s, d->timeout_s + 10);
    return res == AVGPIPE_OK ? res : avgpipe__nccl_errf(m, res, "%s", avgpipe_last_error(&fctx));
}

AVGPIPE_API avgpipe_result avgpipe_nccl_create(avgpipe_context *ctx, const avgpipe_nccl_desc *desc, avgpipe_comm *out) {
    static const char *const fn = "avgpipe_nccl_create";
    avgpipe_nccl_desc d = avgpipe_nccl_query_defaults(desc);
    avgpipe__nccl *m;
    avgpipe_result res;
    ncclUniqueId id;
    int published = 0;
    if (!out) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: out is NULL", fn);
    memset(out, 0, sizeof *out);
    if (!desc) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc is NULL (it says where the communicator comes from)", fn);
    if ((res = avgpipe__nccl_check_desc(ctx, &d, 0, fn)) != AVGPIPE_OK) return res;
    if (d.comm) { /* rank, size and device are the user's communicator's */
        ncclResult_t nr = ncclCommUserRank(d.comm, &d.rank);
        if (nr == ncclSuccess) nr = ncclCommCount(d.comm, &d.size);
        if (nr == ncclSuccess) nr = ncclCommCuDevice(d.comm, &d.device);
        if (nr != ncclSuccess) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: desc->comm: %s", fn, ncclGetErrorString(nr));
    }
    memset(&id, 0, sizeof id);
    if (d.id) id = *d.id;
    m = avgpipe__nccl_new(ctx, &d);
    if (!m) return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "%s: out of memory", fn);
    res = avgpipe__nccl_open_device(m, avgpipe_nccl_local_rank());
    if (d.id_file) {
        res = avgpipe__nccl_file_id(m, &d, res, &id);
        published = res == AVGPIPE_OK && m->rank == 0;
    }
    if (res == AVGPIPE_OK) {
        if (d.comm) {
            ncclComm_t user = d.comm;
            res = avgpipe__nccl_split_one(m, &user, 0, m->rank, &m->comm[AVGPIPE__NCCL_COLL], "ncclCommSplit of desc->comm");
        } else {
            res = avgpipe__nccl_init(m, id);
        }
    }
    if (res == AVGPIPE_OK) res = avgpipe__nccl_complete(m, d.peers, d.npeers, d.lazy_connect);
    if (res != AVGPIPE_OK) {
        if (published) { /* the ranks that have not read the id yet stop at once, with this text */
            avgpipe_context fctx;
            avgpipe_context_init(&fctx, NULL);
            avgpipe_nccl_id_file_write(&fctx, d.id_file, d.file_token, m->size, NULL, 0, m->err[0] ? m->err : "rank 0 failed");
        }
        return avgpipe__nccl_fail(ctx, m, res, fn);
    }
    if (d.id_file && m->rank == 0) remove(d.id_file); /* every rank has joined: no later job may read this id */
    avgpipe__nccl_table(m, out);
    return AVGPIPE_OK;
}

#if defined(MPI_VERSION)
/* Poll an MPI request within the timeout (MPI_Wait has none). */
static avgpipe_result avgpipe__nccl_mpi_wait(avgpipe__nccl *m, MPI_Request *rq, const char *what) {
    double t0 = avgpipe__nccl_now(), sleep_us = 1;
    for (;;) {
        int flag = 0, rc = MPI_Test(rq, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
            char text[MPI_MAX_ERROR_STRING];
            int len = 0;
            if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "MPI error %d", rc);
            else text[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = 0;
            return avgpipe__nccl_errf(m, AVGPIPE_BACKEND_ERROR, "%s: %s", what, text);
        }
        if (flag) return AVGPIPE_OK;
        if (avgpipe__nccl_now() - t0 >= m->desc.timeout_s)
            return avgpipe__nccl_errf(m, AVGPIPE_TIMEOUT, "%s: not every MPI rank joined within %.3g s", what, m->desc.timeout_s);
        avgpipe__nccl_nap(m, t0, &sleep_us);
    }
}

typedef struct avgpipe__nccl_mpi_blob {
    int ok;
    char text[244]; /* rank 0's failure */
    ncclUniqueId id;
} avgpipe__nccl_mpi_blob;

AVGPIPE_API avgpipe_result avgpipe_nccl_create_mpi(avgpipe_context *ctx, const avgpipe_nccl_desc *desc, MPI_Comm comm, avgpipe_comm *out) {
    static const char *const fn = "avgpipe_nccl_create_mpi";
    avgpipe_nccl_desc d = avgpipe_nccl_query_defaults(desc);
    avgpipe__nccl_mpi_blob blob;
    avgpipe__nccl *m;
    avgpipe_result res, ex;
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Request rq;
    int inited = 0, finalized = 0, local = -1, mine, first = 0;
    if (!out) return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: out is NULL", fn);
    memset(out, 0, sizeof *out);
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (!inited || finalized)
        return avgpipe_set_error(ctx, AVGPIPE_STATE_ERROR, "%s: MPI is %s", fn, finalized ? "finalized" : "not initialised (avgpipe_mpi_init)");
    if (comm == MPI_COMM_NULL || MPI_Comm_rank(comm, &d.rank) != MPI_SUCCESS || MPI_Comm_size(comm, &d.size) != MPI_SUCCESS)
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s: comm is not a usable MPI communicator", fn);
    if ((res = avgpipe__nccl_check_desc(ctx, &d, 1, fn)) != AVGPIPE_OK) return res;
    /* collective whatever the rank's description: every rank asks for its node-local rank */
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, d.rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        MPI_Comm_rank(node, &local);
        MPI_Comm_free(&node);
    }
    m = avgpipe__nccl_new(ctx, &d);
    if (!m) return avgpipe_set_error(ctx, AVGPIPE_OUT_OF_MEMORY, "%s: out of memory", fn); /* the others time out */
    res = avgpipe__nccl_open_device(m, local);
    memset(&blob, 0, sizeof blob);
    if (m->rank == 0 && res == AVGPIPE_OK) {
        ncclResult_t nr = ncclGetUniqueId(&blob.id);
        if (nr != ncclSuccess) res = avgpipe__nccl_nccl_error(m, nr, ncclGetLastError(NULL), "ncclGetUniqueId");
    }
    if (m->rank == 0) {
        blob.ok = res == AVGPIPE_OK;
        if (!blob.ok) snprintf(blob.text, sizeof blob.text, "%.243s", m->err);
    }
    /* every rank joins both exchanges, failed or not, so that nobody waits for a rank that gave up */
    ex = MPI_Ibcast(&blob, (int)sizeof blob, MPI_BYTE, 0, comm, &rq) == MPI_SUCCESS ? AVGPIPE_OK
                                                                                    : avgpipe__nccl_errf(m, AVGPIPE_BACKEND_ERROR, "MPI_Ibcast failed");
    if (ex == AVGPIPE_OK) ex = avgpipe__nccl_mpi_wait(m, &rq, "broadcasting the NCCL id (MPI_Ibcast)");
    mine = res == AVGPIPE_OK ? m->size : m->rank;
    if (ex == AVGPIPE_OK)
        ex = MPI_Iallreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm, &rq) == MPI_SUCCESS
                 ? avgpipe__nccl_mpi_wait(m, &rq, "agreeing that every rank is ready (MPI_Iallreduce)")
                 : avgpipe__nccl_errf(m, AVGPIPE_BACKEND_ERROR, "MPI_Iallreduce failed");
    if (res == AVGPIPE_OK && ex != AVGPIPE_OK) res = ex;
    if (res == AVGPIPE_OK && !blob.ok) res = avgpipe__nccl_errf(m, AVGPIPE_BACKEND_ERROR, "rank 0 failed: %.240s", blob.text);
    if (res == AVGPIPE_OK && first < m->size)
        res = avgpipe__nccl_errf(m, AVGPIPE_BACKEND_ERROR, "rank %d could not set up its GPU (see its own error)", first);
    if (res == AVGPIPE_OK) res = avgpipe__nccl_init(m, blob.id);
    if (res == AVGPIPE_OK) res = avgpipe__nccl_complete(m, d.peers, d.npeers, d.lazy_connect);
    if (res != AVGPIPE_OK) return avgpipe__nccl_fail(ctx, m, res, fn);
    avgpipe__nccl_table(m, out);
    return AVGPIPE_OK;
}
#endif /* MPI_VERSION */

static avgpipe_result avgpipe__nccl_split(void *user, int self, const int *members, int count, avgpipe_comm *out) {
    avgpipe__nccl *m = (avgpipe__nccl *)user, *c;
    avgpipe_context ctx;
    avgpipe_context_desc cd;
    avgpipe_nccl_desc d;
    avgpipe_result res;
    int i, key = -1;
    if (!out) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "split: out is NULL");
    memset(out, 0, sizeof *out);
    if (self != m->rank) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "split: self is %d, but this process is rank %d", self, m->rank);
    if (!members || count < 1 || count > m->size)
        return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "split: %d members at %p (1..%d)", count, (const void *)members, m->size);
    for (i = 0; i < count; i++) {
        if (members[i] < 0 || members[i] >= m->size) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "split: members[%d] = %d", i, members[i]);
        if (members[i] == self) key = i;
    }
    if (key < 0) return avgpipe__nccl_errf(m, AVGPIPE_INVALID_ARG, "split: rank %d is not among the %d members it passed", self, count);
    if (avgpipe__nccl_dead(m)) return AVGPIPE_ABORTED;
    if ((res = avgpipe__nccl_use_device(m)) != AVGPIPE_OK) return res;
    memset(&cd, 0, sizeof cd);
    cd.allocator = m->alloc;
    avgpipe_context_init(&ctx, &cd);
    d = m->desc;
    d.rank = key, d.size = count, d.device = m->device;
    c = avgpipe__nccl_new(&ctx, &d);
    if (!c) return avgpipe__nccl_errf(m, AVGPIPE_OUT_OF_MEMORY, "split: out of memory");
    c->parent = m;
    res = avgpipe__nccl_open_device(c, -1);
    for (i = 0; i < AVGPIPE__NCCL_NCOMM && res == AVGPIPE_OK; i++) /* collective over this table: color members[0], key: the index */
        res = avgpipe__nccl_split_one(c, &m->comm[i], members[0], key, &c->comm[i], "split (ncclCommSplit)");
    if (res == AVGPIPE_OK) {
        avgpipe__nccl_table(c, out);
        return AVGPIPE_OK;
    }
    avgpipe__nccl_errf(m, res, "split: %s", c->err[0] ? c->err : avgpipe_result_string(res));
    c->parent = NULL; /* a failed child must not take its parent down */
    avgpipe__nccl_kill(c, "split failed");
    avgpipe__nccl_free(c);
    return res;
}

AVGPIPE_API int avgpipe_nccl_rank(const avgpipe_comm *comm) {
    const avgpipe__nccl *m;
    if (!comm || comm->isend != avgpipe__nccl_isend || !comm->user) return -1;
    m = (const avgpipe__nccl *)comm->user;
    return m->magic == AVGPIPE__NCCL_MAGIC ? m->rank : -1;
}

AVGPIPE_API int avgpipe_nccl_device(const avgpipe_comm *comm) {
    const avgpipe__nccl *m;
    if (!comm || comm->isend != avgpipe__nccl_isend || !comm->user) return -1;
    m = (const avgpipe__nccl *)comm->user;
    return m->magic == AVGPIPE__NCCL_MAGIC ? m->device : -1;
}

#ifdef __cplusplus
}
#endif
#endif /* AVGPIPE_NCCL_IMPLEMENTATION */
