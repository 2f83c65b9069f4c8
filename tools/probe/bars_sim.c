/* bars_sim: driver calls per phase of N buffers in one tag on the simulated driver (issue 27's
 * `bars`), for the figures docs/SLEEP.md quotes without a GPU. For each N (default 1280, 2560,
 * 5120, 10240, 20480) of SIZE bytes (default 2 MiB), with the product's default options: the
 * buffers allocated in one tag, the tag paused (with --backup: VMM_PAUSE_BACKUP) and resumed,
 * the buffers freed, vmm_trim; one row per N with every driver entry point counted per phase,
 * then, per phase, the VMM calls among them (tests/unit/phase_calls.h, which the unit suite
 * test_bulk.c asserts bounds on). Prints figures and judges none; exits 1 when a step failed or
 * the driver still holds anything after the trim.
 * With --backup the backups are this machine's memory (N x SIZE bytes at once).
 * Usage: bars_sim [--backup] [--size BYTES] [N ...] */
#include "simprobe.h"

#include "phase_calls.h"

/* A markdown table's header: the leading columns, then one per name. */
static void header(const char *lead, const char *rule, const char *const *names, size_t n)
{
    printf("%s", lead);
    for (size_t k = 0; k < n; k++)
        printf(" %s |", names[k]);
    printf("\n%s", rule);
    for (size_t k = 0; k < n; k++)
        printf("---|");
    printf("\n");
}

int main(int argc, char **argv)
{
    size_t size = 2 * MiB;
    unsigned flags = 0;
    size_t ns[32], nn = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--backup") == 0)
            flags = VMM_PAUSE_BACKUP;
        else if (strcmp(argv[i], "--size") == 0 && i + 1 < argc)
            size = (size_t)strtoull(argv[++i], NULL, 0);
        else if (nn < sizeof ns / sizeof ns[0] && strtoull(argv[i], NULL, 0) > 0)
            ns[nn++] = (size_t)strtoull(argv[i], NULL, 0);
        else {
            fprintf(stderr, "usage: bars_sim [--backup] [--size BYTES] [N ...]\n");
            return 2;
        }
    }
    if (!nn) {
        static const size_t def[] = {1280, 2560, 5120, 10240, 20480};
        for (nn = 0; nn < sizeof def / sizeof def[0]; nn++)
            ns[nn] = def[nn];
    }
    printf("Driver calls per phase, N x %zu KiB in one tag, simulated driver%s\n\n", size >> 10,
           flags ? ", pause with backup" : "");
    pc_counts_t *c = calloc(nn, sizeof *c);
    bool ok = c != NULL;
    for (size_t i = 0; i < nn && ok; i++) {
        ok = pc_measure(ns[i], size, flags, &c[i]);
        vmh_pause_reset(); /* the kept pinned backups go too */
        if (!sim_ledger_empty()) {
            sim_ledger_dump();
            fprintf(stderr, "bars_sim: the driver still holds memory after the trim\n");
            ok = false;
        }
    }
    header("| N |", "|---|", pc_phase_names, PC_PHASES);
    for (size_t i = 0; ok && i < nn; i++) {
        printf("| %zu |", ns[i]);
        for (int ph = 0; ph < PC_PHASES; ph++)
            printf(" %lu |", c[i].calls[ph][PC_ALL]);
        printf("\n");
    }
    printf("\nThe VMM calls among them (phases that made any)\n\n");
    header("| N | phase |", "|---|---|", pc_call_names, PC_NAMED);
    for (size_t i = 0; ok && i < nn; i++)
        for (int ph = 0; ph < PC_PHASES; ph++) {
            unsigned long any = 0;
            for (size_t k = 0; k < PC_NAMED; k++)
                any += c[i].calls[ph][k];
            if (!any)
                continue;
            printf("| %zu | %s |", ns[i], pc_phase_names[ph]);
            for (size_t k = 0; k < PC_NAMED; k++)
                printf(" %lu |", c[i].calls[ph][k]);
            printf("\n");
        }
    free(c);
    vmh_pause_reset();
    vmh_tags_reset();
    return ok ? 0 : 1;
}
