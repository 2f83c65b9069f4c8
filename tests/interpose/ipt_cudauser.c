/* A library that needs the driver (linked against libcuda.so.1, as libtorch_cuda or cuDNN are),
 * dlopen'ed RTLD_LOCAL by ip_cudart: a dlsym through its handle finds the driver's functions,
 * and must get the hook's wrappers for the interposed ones just as the driver's handle does. */
#include <cuda.h>

int ipt_cudauser_version(void);
int ipt_cudauser_version(void)
{
    int v = 0; /* a reference to the driver keeps it a dependency under --as-needed */
    return cuDriverGetVersion(&v) == CUDA_SUCCESS ? v : -1;
}
