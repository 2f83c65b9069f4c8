/* Debugging aid for the GPU machine (which has no gdb): preload beside libvmmhook.so to get a
 * backtrace on stderr when a program crashes.
 *   gcc -shared -fPIC -O0 -g -o segv.so tools/debug/segv-backtrace.c
 *   LD_PRELOAD=./segv.so:build/src/libvmmhook.so ./program */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>
#include <ucontext.h>

static void on_crash(int sig, siginfo_t *si, void *uc_)
{
    ucontext_t *uc = uc_;
    void *frames[64];
    char msg[128];
    int n = backtrace(frames, 64);
    int len = 0;
    len += (int)strlen(strcpy(msg, "segv-backtrace: signal, fault address, pc follow\n"));
    write(2, msg, (size_t)len);
    (void)si;
#ifdef __x86_64__
    frames[1] = (void *)uc->uc_mcontext.gregs[REG_RIP];
#endif
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_crash;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
}
