/* nccl.h — k3's NCCL stand-in, for the emulation build only (-DK3_CUDA=ON -DK3_CUDA_EMULATE=ON):
 * CMake puts comm/nccl_emu first on the include path there and compiles nccl_emu.c into k3lib
 * instead of linking libnccl, so comm/comm_nccl.c runs under mpirun with no GPU. Not NVIDIA's
 * header: our own declarations of the subset of the NCCL API that comm_nccl.c uses, with NCCL's
 * names, signatures and result codes (the enum values are NCCL's, so a log reads the same):
 * communicators (unique id, init with a config, split, abort, destroy, the async error), groups,
 * and point-to-point send/recv. No collectives (k3 does not use them).
 *
 * Semantics (nccl_emu.c): a communicator is an MPI communicator (init: a dup of MPI_COMM_WORLD,
 * whose size and rank must be nranks and rank; split: MPI_Comm_split); "device" buffers are host
 * memory (the CUDA emulation's), sent as bytes. Because every emulated stream operation runs
 * inside the call that enqueues it, ncclGroupEnd returns only when its operations are complete
 * (or at the stand-in's deadline, K3_NCCL_EMU_TIMEOUT_S, default 120 s; see nccl_emu.c for what
 * happens then). Not thread-safe beyond NCCL's own rule (a group belongs to one thread). */
#ifndef K3_NCCL_EMU_NCCL_H
#define K3_NCCL_EMU_NCCL_H

#include <limits.h>
#include <stddef.h>

#include <cuda_runtime_api.h> /* cudaStream_t (the emulation's) */

#ifdef __cplusplus
extern "C" {
#endif

#define K3_NCCL_EMULATION 1 /* this header is the stand-in's, not NVIDIA's */

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2, /* here: an MPI call failed, or operations completed too late */
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6, /* here: a peer did not take part before the deadline */
    ncclInProgress = 7,  /* non-blocking communicators only */
    ncclNumResults = 8
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclChar = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclInt = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclHalf = 6,
    ncclFloat32 = 7,
    ncclFloat = 7,
    ncclFloat64 = 8,
    ncclDouble = 8,
    ncclBfloat16 = 9,
    ncclNumTypes = 10
} ncclDataType_t;

typedef struct k3nccl_comm *ncclComm_t;

/* The bootstrap handle rank 0 makes and every rank receives (k3: an MPI_Bcast). */
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

/* Communicator options. Only `blocking` means anything here: with 0, a group end that reaches the
 * deadline returns ncclInProgress with its operations still pending, as NCCL's non-blocking mode
 * may (nccl_emu.c); init and split complete (or fail) before they return either way. */
#define NCCL_CONFIG_UNDEF_INT INT_MIN
typedef struct ncclConfig_v_k3emu {
    size_t size;      /* sizeof(ncclConfig_t) */
    unsigned magic;   /* set by NCCL_CONFIG_INITIALIZER; checked */
    unsigned version; /* of this struct */
    int blocking;     /* 1 (default) or 0 */
} ncclConfig_t;
#define K3_NCCL_EMU_CONFIG_MAGIC 0x6b336e63u /* "k3nc" */
#define NCCL_CONFIG_INITIALIZER                                                                    \
    { sizeof(ncclConfig_t), K3_NCCL_EMU_CONFIG_MAGIC, 1u, NCCL_CONFIG_UNDEF_INT }

/* ncclCommSplit's color for a rank that joins no new communicator (*newcomm = NULL). */
#define NCCL_SPLIT_NOCOLOR -1

const char *ncclGetErrorString(ncclResult_t result);

ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
/* Collective over MPI_COMM_WORLD (nranks and rank must be its size and this process's rank). */
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config);
/* Collective over comm. config NULL: the parent's blocking mode. */
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config);
/* The communicator's sticky state: ncclSuccess, ncclInProgress (operations still pending after a
 * group end returned at the deadline) or the error that broke it. */
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
/* Never blocks: cancels and frees what is pending and drops the communicator. */
ncclResult_t ncclCommAbort(ncclComm_t comm);
/* Frees the communicator (as ncclCommAbort when it failed or still has operations pending). */
ncclResult_t ncclCommDestroy(ncclComm_t comm);

ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
/* count in elements of datatype. Outside a group, each call is a group of its own. */
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* K3_NCCL_EMU_NCCL_H */
