/* simdrv: memory shared between processes. Shareable handles (cuMemExportToShareableHandle as a
 * POSIX descriptor, a memfd whose inode names the allocation; cuMemImportFromShareableHandle
 * of such a descriptor exported by this process: the simulation has one process's state) and
 * legacy IPC (cuIpcGetMemHandle of a native block; cuIpcOpenMemHandle refuses this process's own
 * handles as the driver does, and cannot open another process's memory). */
#include "simint.h"

/* ---------------------------------------------------------------------------------------- */
/* Shareable handles                                                                        */

CUresult SIM_IMPL(cuMemExportToShareableHandle)(void *shareable,
                                                 CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType type,
                                                 unsigned long long flags)
{
    SIM_ENTER(cuMemExportToShareableHandle);
    NEED_INIT();
    if (!shareable)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemExportToShareableHandle: NULL");
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemExportToShareableHandle: flags");
    sim_handle_t *h = handle_find(handle);
    if (!h)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemExportToShareableHandle: unknown handle");
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
        !(h->a->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuMemExportToShareableHandle: type %d not requested at creation (0x%x)",
                      type, (unsigned)h->a->prop.requestedHandleTypes);
    int fd = memfd_create("simdrv-export", MFD_CLOEXEC);
    if (fd < 0)
        return reject(CUDA_ERROR_OUT_OF_MEMORY, "memfd_create: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st)) {
        close(fd);
        return reject(CUDA_ERROR_UNKNOWN, "fstat: %s", strerror(errno));
    }
    size_t i;
    for (i = 0; i < S.nexports; i++)
        if (S.exports[i].dev == st.st_dev && S.exports[i].ino == st.st_ino)
            break;
    if (i == S.nexports) {
        if (S.nexports == S.capexports) {
            S.capexports = S.capexports ? 2 * S.capexports : 16;
            S.exports = xrealloc(S.exports, S.capexports * sizeof *S.exports);
        }
        S.nexports++;
    }
    S.exports[i] = (sim_export_t){.dev = st.st_dev, .ino = st.st_ino, .a = h->a};
    *(int *)shareable = fd;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *handle,
                                                   void *os_handle, CUmemAllocationHandleType type)
{
    SIM_ENTER(cuMemImportFromShareableHandle);
    NEED_INIT();
    if (!handle)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemImportFromShareableHandle: NULL");
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return reject(type == CU_MEM_HANDLE_TYPE_WIN32 || type == CU_MEM_HANDLE_TYPE_WIN32_KMT
                          ? CUDA_ERROR_NOT_SUPPORTED
                          : CUDA_ERROR_INVALID_VALUE,
                      "cuMemImportFromShareableHandle: type %d", type);
    int fd = (int)(intptr_t)os_handle;
    struct stat st;
    if (fd < 0 || fstat(fd, &st))
        return reject(CUDA_ERROR_INVALID_VALUE, "cuMemImportFromShareableHandle: bad fd %d", fd);
    for (size_t i = 0; i < S.nexports; i++)
        if (S.exports[i].dev == st.st_dev && S.exports[i].ino == st.st_ino) {
            *handle = handle_new(S.exports[i].a);
            return CUDA_SUCCESS;
        }
    return reject(CUDA_ERROR_INVALID_VALUE,
                  "cuMemImportFromShareableHandle: fd %d is no live export of this process", fd);
}

/* ---------------------------------------------------------------------------------------- */
/* Legacy IPC                                                                                */

#define IPC_MAGIC 0x51d1bc00u

typedef struct ipc_payload {
    unsigned magic;
    int pid;
    unsigned long long id;
    CUdeviceptr ptr;
    size_t size;
} ipc_payload_t;

CUresult SIM_IMPL(cuIpcGetMemHandle)(CUipcMemHandle *handle, CUdeviceptr dptr)
{
    SIM_ENTER(cuIpcGetMemHandle);
    NEED_CTX(dev);
    (void)dev;
    if (!handle)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuIpcGetMemHandle: NULL");
    sim_native_t *n = vec_find(&S.natives, dptr);
    if (!n || dptr - n->iv.ptr >= n->size)
        return reject(CUDA_ERROR_INVALID_VALUE,
                      "cuIpcGetMemHandle: 0x%llx is not a cuMemAlloc block",
                      (unsigned long long)dptr);
    ipc_payload_t pl = {IPC_MAGIC, (int)getpid(), n->id, n->iv.ptr, n->size};
    memset(handle, 0, sizeof *handle);
    memcpy(handle->reserved, &pl, sizeof pl);
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuIpcOpenMemHandle)(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                       unsigned int flags)
{
    SIM_ENTER(cuIpcOpenMemHandle);
    NEED_CTX(dev);
    (void)dev;
    if (!pdptr)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuIpcOpenMemHandle: NULL");
    if (flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuIpcOpenMemHandle: flags %u", flags);
    ipc_payload_t pl;
    memcpy(&pl, handle.reserved, sizeof pl);
    if (pl.magic != IPC_MAGIC)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuIpcOpenMemHandle: not a handle");
    if (pl.pid == (int)getpid())
        return reject(CUDA_ERROR_INVALID_CONTEXT,
                      "%s", "cuIpcOpenMemHandle: handle of this same process");
    return reject(CUDA_ERROR_MAP_FAILED, "%s",
                  "cuIpcOpenMemHandle: other processes' memory is not simulated");
}

CUresult SIM_IMPL(cuIpcCloseMemHandle)(CUdeviceptr dptr)
{
    SIM_ENTER(cuIpcCloseMemHandle);
    NEED_CTX(dev);
    (void)dev;
    return reject(CUDA_ERROR_INVALID_VALUE, "cuIpcCloseMemHandle: 0x%llx was not opened",
                  (unsigned long long)dptr);
}
