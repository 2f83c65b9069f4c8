/* Stands for NVIDIA's cuBLASLt in the interpose suite (built as libcublasLt.so): it makes a
 * stream for its own use, as the real one does at its first heuristic query (seen on the H200
 * under every PyTorch matrix product). Linked against the driver, so its cuStreamCreate binds
 * to the preloaded library, which sees this library as the caller. Built without sibling calls
 * (meson.build): a tail call would hide the caller. */
#include <cuda.h>

CUresult ipt_cublaslt_make_stream(CUstream *s);

CUresult ipt_cublaslt_make_stream(CUstream *s)
{
    CUresult r = cuStreamCreate(s, CU_STREAM_NON_BLOCKING);
    return r;
}
